"""The `sluice` command line (typer): one entry point for every process kind.

Only commands that work are listed; each has `--help`, and `--json` where a machine may
read the output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from sluice import __version__, cli_batch, cli_billing, cli_bulk, cli_serving
from sluice.cli_common import CONTEXT_SETTINGS, DataDir, emit_json, settings_or_exit
from sluice.settings import EngineWorkerSettings, GatewaySettings, Settings, SettingsError

app = typer.Typer(
    name="sluice",
    help="Sluice: an event-driven LLM inference pipeline (OpenAI-compatible, Kafka lanes).",
    no_args_is_help=True,
    add_completion=False,
    context_settings=CONTEXT_SETTINGS,
    # click's plain help: it wraps long option names where rich's table cuts them off,
    # and keeps brackets in help text as written (rich reads "[default: …]" as markup)
    rich_markup_mode=None,
)

# each command that keeps state takes --data-dir and secures the dir itself before use
cli_serving.register(app)
cli_billing.register(app)
cli_batch.register(app)  # an HTTP client of a running server: no data dir
cli_bulk.register(app)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sluice {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print version.")
    ] = False,
) -> None:
    """Sluice command line."""


@app.command()
def doctor(as_json: JsonFlag = False, data_dir: DataDir = None) -> None:
    """Check each configured service and say what is wrong, one line each."""
    from sluice.doctor import run_checks

    settings = settings_or_exit(Settings, data_dir=data_dir)
    checks = run_checks(settings)
    if as_json:
        emit_json({"ok": all(c.ok for c in checks), "checks": [c.as_dict() for c in checks]})
    else:
        for c in checks:
            mark = "ok  " if c.ok else "FAIL"
            fix = f" -> {c.fix}" if not c.ok and c.fix else ""
            typer.echo(f"{mark} {c.name:<9} {c.detail}{fix}")
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


@app.command("config")
def show_config(
    as_json: JsonFlag = False,
    changed: Annotated[
        bool, typer.Option("--changed", help="Only the settings whose value is not the default.")
    ] = False,
) -> None:
    """Every SLUICE_* setting: its default, its value here and what it does (docs/settings.md)."""
    from sluice.settings_doc import current_values, entries, render_settings_table

    current = current_values(
        settings_or_exit(GatewaySettings), settings_or_exit(EngineWorkerSettings)
    )
    if as_json:
        emit_json({"settings": [e for e in entries(current) if e["changed"] or not changed]})
        return
    width = shutil.get_terminal_size((120, 24)).columns
    typer.echo(render_settings_table(current, width, changed_only=changed), nl=False)


@app.command(
    context_settings={**CONTEXT_SETTINGS, "allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def bench(ctx: typer.Context) -> None:
    """Benchmarks that print ratios against a peer run side by side (source checkout)."""
    # benchmarks/ is a client of the package, not part of it (the wheel leaves it out): it
    # runs as its own program from the checkout this package was installed from
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__main__.py").is_file():
        typer.echo(
            "sluice bench: the benchmarks ship with the source, not the wheel; run it from a "
            "clone of the repository (pip install -e .)",
            err=True,
        )
        raise typer.Exit(2)
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "benchmarks", *ctx.args]
    raise typer.Exit(subprocess.call(argv, env={**os.environ, "PYTHONPATH": path}))


def main() -> None:
    try:
        app(prog_name="sluice")
    except SettingsError as exc:  # found while starting (e.g. a model that is not there)
        typer.echo(f"configuration error: {exc}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
