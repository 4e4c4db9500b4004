"""CLI for tenancy and billing: `migrate`, `tenants` (limits, allowed models), `keys`,
`billing report`, `prices`.

`register(app)` adds them to the `sluice` app. Without SLUICE_DATABASE_URL they use the
SQLite file of the data dir (`--data-dir`, else SLUICE_DATA_DIR), created owner-only and
migrated on first use (WAL mode, so this works while `sluice serve` runs). Bad input
exits 2 with one line on stderr; an unreachable or unmigrated database exits 1.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any

import typer

from sluice.billing import admin
from sluice.billing.reports import render_csv, render_png, render_table
from sluice.cli_common import CONTEXT_SETTINGS, FLAGS, DataDir, secure_data_dir
from sluice.settings import Settings, SettingsError, load_settings
from sluice.storage.db import Database, embedded_url, is_current, make_engine, migrate
from sluice.storage.errors import InvalidInput, StoreError

tenants_app = typer.Typer(
    help="Create and list tenants (each with its own plan limits).",
    context_settings=CONTEXT_SETTINGS,
)
keys_app = typer.Typer(
    help="Create, list and revoke API keys (shown once at creation).",
    context_settings=CONTEXT_SETTINGS,
)
billing_app = typer.Typer(
    help="Usage and cost reports from the usage ledger.", context_settings=CONTEXT_SETTINGS
)
prices_app = typer.Typer(
    help="The price book: USD per million tokens per model.", context_settings=CONTEXT_SETTINGS
)

_DRIVER_MODULES = {"sqlalchemy", "psycopg", "sqlite3", "alembic"}
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]
Allow = Annotated[
    list[str] | None,
    typer.Option(
        "--allow",
        metavar="MODEL",
        help="A served name (model, alias or LoRA adapter) its keys may use; repeat for"
        " several; others answer 404 as if they did not exist.",
        show_default="every model",
    ),
]
_NO_LIMIT = "no limit"  # a plan limit left unset is not enforced


def register(app: typer.Typer) -> None:
    """Add `migrate`, `tenants`, `keys`, `billing` and `prices` to the `sluice` app."""
    app.command("migrate")(migrate_command)
    app.add_typer(tenants_app, name="tenants")
    app.add_typer(keys_app, name="keys")
    app.add_typer(billing_app, name="billing")
    app.add_typer(prices_app, name="prices")


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@contextmanager
def _database(data_dir: Path | None, *, require_current: bool = True) -> Iterator[Database]:
    """The configured database; embedded SQLite is created (owner-only) and migrated on
    first use."""
    try:
        settings = load_settings(Settings, flags=FLAGS, data_dir=data_dir)
    except SettingsError as exc:
        raise _fail(str(exc).replace("\n", "; "), 2) from exc
    db: Database | None = None
    try:
        if settings.database_url is None:
            secure_data_dir(settings)  # before SQLite creates it with the umask's mode
            db = Database.connect(embedded_url(settings.data_dir), migrate_if_needed=True)
        else:
            db = Database(make_engine(settings.database_url))
            if require_current and not is_current(db.engine):
                raise _fail("the database is not migrated: run `sluice migrate` first", 1)
        yield db
    except InvalidInput as exc:
        raise _fail(str(exc), 2) from exc
    except StoreError as exc:
        raise _fail(str(exc), 1) from exc
    except Exception as exc:
        if type(exc).__module__.split(".")[0] not in _DRIVER_MODULES:
            raise
        # driver errors (connection refused, bad password, missing table): one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _fail(f"database: {first}", 1) from exc
    finally:
        if db is not None:
            db.close()


def _emit(payload: Any) -> None:
    typer.echo(json.dumps(payload, indent=2, default=str))


def migrate_command(data_dir: DataDir = None) -> None:
    """Create or upgrade the billing database schema to the latest revision."""
    with _database(data_dir, require_current=False) as db:
        migrate(db.engine)
        typer.echo(f"database at revision head ({db.dialect})")


@tenants_app.command("create")
def tenants_create(
    name: Annotated[str, typer.Argument(help="Unique tenant name.")],
    rpm: Annotated[
        int | None, typer.Option(help="Requests per minute.", min=0, show_default=_NO_LIMIT)
    ] = None,
    tpm: Annotated[
        int | None, typer.Option(help="Tokens per minute.", min=0, show_default=_NO_LIMIT)
    ] = None,
    max_concurrency: Annotated[
        int | None, typer.Option(help="Requests in flight at once.", min=0, show_default=_NO_LIMIT)
    ] = None,
    monthly_budget: Annotated[
        str | None, typer.Option(help="Monthly budget in USD, e.g. 25.00.", show_default=_NO_LIMIT)
    ] = None,
    allow: Allow = None,
    as_json: JsonFlag = False,
    data_dir: DataDir = None,
) -> None:
    """Create a tenant with its limits and a first API key (the key is shown once)."""
    with _database(data_dir) as db:
        row = admin.create_tenant(db, name, rpm=rpm, tpm=tpm, max_concurrency=max_concurrency,
                                  monthly_budget_usd=monthly_budget,
                                  allowed_models=allow)  # fmt: skip
    if as_json:
        _emit({k: row[k] for k in ("tenant_id", "name", "key_id", "api_key")})
        return
    typer.echo(f"tenant {row['name']} ({row['tenant_id']})")
    typer.echo(f"API key (shown once, store it now): {row['api_key']}")


@tenants_app.command("list")
def tenants_list(as_json: JsonFlag = False, data_dir: DataDir = None) -> None:
    """List tenants with their limits."""
    with _database(data_dir) as db:
        rows = admin.list_tenants(db)
    if as_json:
        _emit(rows)
        return
    for r in rows:
        typer.echo(
            f"{r['tenant_id']}  {r['name']:<20} rpm={r['rpm'] or '-'} tpm={r['tpm'] or '-'} "
            f"concurrency={r['max_concurrency'] or '-'} "
            f"budget_usd={r['monthly_budget_usd'] or '-'} models={_models(r['allowed_models'])}"
        )


def _models(allowed: list[str] | None) -> str:
    return "all" if allowed is None else ",".join(allowed) or "none"


@tenants_app.command("models")
def tenants_models(
    tenant: Annotated[str, typer.Argument(help="Tenant name or id.")],
    allow: Allow = None,
    every: Annotated[
        bool, typer.Option("--all", help="Every model the deployment serves (the default).")
    ] = False,
    as_json: JsonFlag = False,
    data_dir: DataDir = None,
) -> None:
    """Set the models a tenant may use (--allow, repeated), or every model (--all); its own
    private LoRA adapters are always its own. Gateways apply it within 5 s."""
    if every == bool(allow):
        raise _fail("give --allow MODEL (repeatable) or --all", 2)
    with _database(data_dir) as db:
        row = admin.set_allowed_models(db, tenant, None if every else allow)
    if as_json:
        _emit(row)
        return
    models = _models(row["allowed_models"])
    typer.echo(f"tenant {row['name']} ({row['tenant_id']}): models={models}")


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant name or id.")],
    name: Annotated[str | None, typer.Option(help="A label for the key.")] = None,
    as_json: JsonFlag = False,
    data_dir: DataDir = None,
) -> None:
    """Create an API key for a tenant; the plaintext is printed once and never stored."""
    with _database(data_dir) as db:
        row = admin.create_key(db, tenant, name)
    if as_json:
        _emit(row)
    else:
        typer.echo(f"key {row['key_id']} for {row['tenant_id']} (shown once): {row['api_key']}")


@keys_app.command("list")
def keys_list(
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="Only this tenant.", show_default="all")
    ] = None,
    as_json: JsonFlag = False,
    data_dir: DataDir = None,
) -> None:
    """List keys (prefix only, never the secret)."""
    with _database(data_dir) as db:
        rows = admin.list_keys(db, tenant)
    if as_json:
        _emit(rows)
        return
    for r in rows:
        state = "revoked" if r["revoked_at"] else "active"
        typer.echo(f"{r['key_id']}  {r['tenant']:<20} {r['prefix']}  {state}")


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key id (key_…).")],
    data_dir: DataDir = None,
) -> None:
    """Revoke a key; gateways stop accepting it within their auth cache TTL (5 s)."""
    with _database(data_dir) as db:
        admin.revoke_key(db, key_id)
    typer.echo(f"revoked {key_id}")


def _date(value: str | None, flag: str) -> dt.date | None:
    try:
        return admin.parse_day(value, flag)
    except InvalidInput as exc:
        raise _fail(str(exc), 2) from exc


@billing_app.command("report")
def billing_report(
    tenant: Annotated[
        str | None, typer.Option(help="Tenant name or id.", show_default="all")
    ] = None,
    since: Annotated[str | None, typer.Option(help="First day, YYYY-MM-DD (UTC).")] = None,
    until: Annotated[str | None, typer.Option(help="Last day, YYYY-MM-DD, inclusive.")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, csv, json or png.")] = "table",
    output: Annotated[
        Path | None, typer.Option(help="Write to this file.", show_default="stdout")
    ] = None,
    data_dir: DataDir = None,
) -> None:
    """Requests, tokens and cost by model and by day."""
    if fmt not in ("table", "csv", "json", "png"):
        raise _fail(f"--format must be table, csv, json or png, got {fmt!r}", 2)
    if fmt == "png" and output is None:
        raise _fail("--format png needs --output FILE.png", 2)
    first, last = _date(since, "--since"), _date(until, "--until")
    if first and last and first > last:
        raise _fail("--since is after --until", 2)
    with _database(data_dir) as db:
        report = admin.report(db, tenant=tenant, since=first, until=last)
    if fmt == "png":
        assert output is not None
        render_png(report, output)
        typer.echo(f"wrote {output}")
        return
    text = {
        "table": lambda: render_table(report),
        "csv": lambda: render_csv(report),
        "json": lambda: json.dumps(report.as_dict(), indent=2) + "\n",
    }[fmt]()
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        typer.echo(f"wrote {output}")


@prices_app.command("set")
def prices_set(
    model: Annotated[str, typer.Argument(help="Model name as clients send it.")],
    input_usd: Annotated[str, typer.Option("--input", help="USD per 1M input tokens.")],
    output_usd: Annotated[str, typer.Option("--output", help="USD per 1M output tokens.")],
    cached_input_usd: Annotated[
        str | None,
        typer.Option(
            "--cached-input",
            help="USD per 1M cached input tokens.",
            show_default="the input price",
        ),
    ] = None,
    batch_discount: Annotated[
        str, typer.Option(help="Fraction off on the batch lane, e.g. 0.5 for 50% off.")
    ] = "0",
    data_dir: DataDir = None,
) -> None:
    """Set (or replace) a model's prices; applies to usage recorded from now on."""
    # no discount stated: a prefix-cache hit bills as the input it replaced
    cached_input_usd = input_usd if cached_input_usd is None else cached_input_usd
    with _database(data_dir) as db:
        row = admin.set_price(db, model, input_usd=input_usd, cached_input_usd=cached_input_usd,
                              output_usd=output_usd, batch_discount=batch_discount)  # fmt: skip
    typer.echo(f"{row['model']}: input {input_usd}, cached {cached_input_usd}, "
               f"output {output_usd} USD/1M tokens, "
               f"batch discount {_percent(row['batch_discount'])}")  # fmt: skip


def _percent(fraction: str) -> str:
    """'0.5' → '50%', '0.125' → '12.5%' (the price book keeps basis points)."""
    return f"{(Decimal(fraction) * 100).normalize():f}%"


@prices_app.command("list")
def prices_list(as_json: JsonFlag = False, data_dir: DataDir = None) -> None:
    """List the price book (USD per million tokens)."""
    with _database(data_dir) as db:
        rows = admin.list_prices(db)
    if as_json:
        _emit(rows)
        return
    if not rows:
        typer.echo(
            "no prices set: usage is recorded unpriced (cost 0) until "
            "`sluice prices set MODEL --input X --cached-input Y --output Z`"
        )
        return
    for r in rows:
        off = _percent(r["batch_discount"])
        typer.echo(f"{r['model']:<30} in {r['input_usd']:>10}  cached {r['cached_input_usd']:>10}"
                   f"  out {r['output_usd']:>10}  batch {off:>6} off")  # fmt: skip
