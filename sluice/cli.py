"""The `sluice` command line (typer): one entry point for every process kind.

Only commands that work are listed; each has `--help`, and `--json` where a machine may
read the output.
"""

from __future__ import annotations

from typing import Annotated

import typer

from sluice import __version__, cli_billing, cli_serving
from sluice.cli_common import emit, emit_json, settings_or_exit
from sluice.settings import Settings

app = typer.Typer(
    name="sluice",
    help="Sluice: an event-driven LLM inference pipeline (OpenAI-compatible, Kafka lanes).",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks that print ratios against a peer run side by side.")
app.add_typer(bench_app, name="bench")
cli_serving.register(app)
cli_billing.register(app)

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
def doctor(as_json: JsonFlag = False) -> None:
    """Check each configured service and say what is wrong, one line each."""
    from sluice.doctor import run_checks

    settings = settings_or_exit(Settings)
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


KafkaOption = Annotated[
    str | None,
    typer.Option(help="Kafka bootstrap; default $SLUICE_KAFKA_BOOTSTRAP or a Tansu started here."),
]


@bench_app.command("bus")
def bench_bus(
    as_json: JsonFlag = False,
    quick: Annotated[bool, typer.Option(help="Fewer messages (seconds, not a minute).")] = False,
    kafka: KafkaOption = None,
) -> None:
    """Produce→consume latency p50/p99 and messages/s, memory bus vs Kafka."""
    from benchmarks.bus import render, run

    settings = settings_or_exit(Settings)
    result = run(kafka_bootstrap=kafka or settings.kafka_bootstrap, quick=quick)
    emit(result, render, as_json)


@bench_app.command("admission")
def bench_admission(
    as_json: JsonFlag = False,
    quick: Annotated[bool, typer.Option(help="2000 requests instead of 10000.")] = False,
    redis: Annotated[
        str | None,
        typer.Option(help="Redis URL; default $SLUICE_REDIS_URL (in-process only when unset)."),
    ] = None,
) -> None:
    """What auth + admission add per request, p50/p99: in-process quotas vs Redis."""
    from benchmarks.admission import render, run

    settings = settings_or_exit(Settings)
    result = run(redis_url=redis or settings.redis_url, quick=quick)
    emit(result, render, as_json)


@bench_app.command("engine")
def bench_engine(
    as_json: JsonFlag = False,
    quick: Annotated[bool, typer.Option(help="A smaller run (under two minutes).")] = False,
    model: Annotated[
        str | None, typer.Option(help="A Hugging Face model directory (default: h512 L8 preset).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32, the same on every side.")] = (
        "bfloat16"
    ),
    gguf: Annotated[
        str | None, typer.Option(help="GGUF of the same weights, for llama.cpp when installed.")
    ] = None,
    gguf_q8: Annotated[
        str | None, typer.Option(help="q8_0 GGUF of the same weights, beside Sluice's int8.")
    ] = None,
) -> None:
    """Sluice's engine vs HF generate and transformers continuous batching, side by side.

    Needs transformers, from the project's test extra.
    """
    settings = settings_or_exit(Settings)
    try:
        from benchmarks.engine import render, run
    except ImportError as exc:
        typer.echo(f"bench engine needs the test extra: pip install -e '.[test]' ({exc})", err=True)
        raise typer.Exit(2) from exc
    result = run(
        quick=quick,
        model=model,
        dtype=dtype,
        data_dir=str(settings.data_dir),
        gguf=gguf,
        gguf_q8=gguf_q8,
    )
    emit(result, render, as_json)


@bench_app.command("serving")
def bench_serving(
    as_json: JsonFlag = False,
    quick: Annotated[bool, typer.Option(help="Two rates, fewer requests (about 4 min).")] = False,
    kafka: KafkaOption = None,
    engine_cpus: Annotated[
        str,
        typer.Option(
            help="Cores of both arms' engine threads, the rest of the run on the others:"
            " 'auto' (the last torch-threads cores), a list such as '1-3', or 'none' (as"
            " SLUICE_ENGINE_CPUS unset)."
        ),
    ] = "none",
) -> None:
    """TTFT, ITL and tokens/s p50/p99, engine called directly vs through Kafka, side by side.

    Over a request-rate sweep on tiny-llama; plus the bus round trip, a priority run
    (interactive beside a saturating batch backlog) and a fairness run (10:1 tenants).
    """
    from benchmarks.serving import render, run

    settings = settings_or_exit(Settings)
    result = run(
        quick=quick,
        kafka_bootstrap=kafka or settings.kafka_bootstrap,
        data_dir=str(settings.data_dir),
        engine_cpus=engine_cpus,
    )
    emit(result, render, as_json)


def main() -> None:
    app(prog_name="sluice")


if __name__ == "__main__":
    main()
