"""`sluice bench`: each benchmark's command (typer); run as `python -m benchmarks`.

The `sluice` command hands `bench ...` to this program from the source checkout, so the
installed package never imports its benchmarks.
"""

from __future__ import annotations

from typing import Annotated

import typer

from sluice.cli_common import CONTEXT_SETTINGS, DataDir, emit, settings_or_exit
from sluice.settings import Settings

bench_app = typer.Typer(
    help="Benchmarks that print ratios against a peer run side by side.",
    no_args_is_help=True,
    add_completion=False,
    context_settings=CONTEXT_SETTINGS,
    rich_markup_mode=None,
)
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


KafkaOption = Annotated[
    str | None,
    typer.Option(
        help="Kafka bootstrap.", show_default="$SLUICE_KAFKA_BOOTSTRAP, else a Tansu started here"
    ),
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
        typer.Option(
            help="Redis URL.", show_default="$SLUICE_REDIS_URL, else quotas in this process"
        ),
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
        str | None,
        typer.Option(
            help="A Hugging Face model directory, a .gguf file or a preset name.",
            show_default="h512 L8 preset",
        ),
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
    vllm: Annotated[
        bool, typer.Option(help="Add vLLM's CPU build, installed by `scripts/peers vllm`.")
    ] = False,
    quantization: Annotated[
        str | None, typer.Option(help="Sluice's weights: gguf (a GGUF's blocks) or none.")
    ] = None,
    data_dir: DataDir = None,
) -> None:
    """Sluice's engine vs HF generate and transformers continuous batching, side by side.

    Needs transformers, from the project's test extra.
    """
    settings = settings_or_exit(Settings, data_dir=data_dir)
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
        vllm=vllm,
        quantization=quantization,
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
    vllm: Annotated[
        bool,
        typer.Option(
            help="Instead: `sluice serve` vs vLLM's CPU server (`scripts/peers vllm`) over"
            " HTTP, a burst of 64 requests and a light Poisson rate (quick ~4 min, full ~8)."
        ),
    ] = False,
    vllm_threads_bind: Annotated[
        str | None,
        typer.Option(help="vLLM's VLLM_CPU_OMP_THREADS_BIND.", show_default="vLLM's default"),
    ] = None,
    data_dir: DataDir = None,
) -> None:
    """TTFT, ITL and tokens/s p50/p99, engine called directly vs through Kafka, side by side.

    Over a request-rate sweep on tiny-llama; plus the bus round trip, a priority run
    (interactive beside a saturating batch backlog) and a fairness run (10:1 tenants).
    With --vllm: `sluice serve` against vLLM's CPU server on the same model instead.
    """
    settings = settings_or_exit(Settings, data_dir=data_dir)
    if vllm:
        from benchmarks import serving_vllm

        peer = serving_vllm.PeerSettings(threads_bind=vllm_threads_bind)
        result = serving_vllm.run(quick=quick, data_dir=str(settings.data_dir), peer=peer)
        emit(result, serving_vllm.render, as_json)
        return
    from benchmarks.serving import render, run

    result = run(
        quick=quick,
        kafka_bootstrap=kafka or settings.kafka_bootstrap,
        data_dir=str(settings.data_dir),
        engine_cpus=engine_cpus,
    )
    emit(result, render, as_json)


@bench_app.command("batch")
def bench_batch(
    as_json: JsonFlag = False,
    lines: Annotated[int, typer.Option(help="Lines of the measured batch.")] = 1000,
    max_tokens: Annotated[int, typer.Option(help="Tokens each line generates.")] = 32,
    rounds: Annotated[int, typer.Option(help="Rounds of each throughput arm (ABBA).")] = 2,
    window_s: Annotated[float, typer.Option(help="Each interactive TTFT window.")] = 30.0,
) -> None:
    """The Batch API through `sluice serve`, and `sluice bulk`, vs the engine called directly.

    Tokens/s of one batch (and of `sluice bulk`) against the same requests straight into
    the same engine in this process, and interactive TTFT p50/p99 alone vs while a batch
    runs. Starts `sluice serve` with a scratch data dir of its own (about 3 min).
    """
    from benchmarks.batch import render, run

    emit(run(lines, max_tokens, rounds, window_s), render, as_json)


@bench_app.command("scale")
def bench_scale(
    as_json: JsonFlag = False,
    quick: Annotated[
        bool, typer.Option(help="One 12 s round per size, probe from 25 streams (~4 min; full ~8).")
    ] = False,
    kafka: KafkaOption = None,
    backend: Annotated[
        str, typer.Option(help="The workers' SLUICE_BACKEND: 'sim', or 'torch' (tiny-llama).")
    ] = "sim",
    sim_preset: Annotated[
        str | None, typer.Option(help="The workers' SLUICE_SIM_PRESET.", show_default="theirs")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Each worker's batch (max_num_seqs).")] = 64,
    data_dir: DataDir = None,
) -> None:
    """Tokens/s, requests/s and TTFT p50/p99 of 1, 2 and 4 engine workers behind one gateway.

    On Kafka, a closed loop of 2 x max_num_seqs x N streams saturating each size, the
    ratio to one worker and the CPU of the gateway, workers and broker; then how many
    concurrent streams one gateway holds before its p99 added TTFT passes 50 ms.
    """
    from benchmarks.scale import render, run

    settings = settings_or_exit(Settings, data_dir=data_dir)
    result = run(
        quick=quick,
        kafka_bootstrap=kafka or settings.kafka_bootstrap,
        data_dir=str(settings.data_dir),
        backend=backend,
        sim_preset=sim_preset,
        max_num_seqs=max_num_seqs,
    )
    emit(result, render, as_json)


@bench_app.command("overload")
def bench_overload(
    as_json: JsonFlag = False,
    quick: Annotated[
        bool, typer.Option(help="6 s steps instead of 12 s (~1.5 min; full ~3).")
    ] = False,
) -> None:
    """Goodput, admitted p99 TTFT and share refused from 0.5x to 3x capacity, SLO admission
    on and off (gateway and worker in this process, the sim backend, interactive lane)."""
    from benchmarks.overload import render, run

    emit(run(quick=quick), render, as_json)


@bench_app.command("coldstart")
def bench_coldstart(
    as_json: JsonFlag = False,
    backend: Annotated[
        list[str] | None, typer.Option(help="sim, torch (repeatable).", show_default="both")
    ] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Cold starts per backend.")] = 3,
    waiting: Annotated[int, typer.Option(min=1, help="Requests waiting at zero.")] = 4,
) -> None:
    """Time to first token from a pool at zero: requests wait in its topics, an engine
    worker starts (sim, then torch on $SLUICE_MODEL), each request's first token; beside
    the same requests to the warm worker. Runs a Tansu and `sluice gateway` itself."""
    from benchmarks.coldstart import render, run

    emit(run(tuple(backend or ("sim", "torch")), rounds, waiting), render, as_json)


@bench_app.command("observability")
def bench_observability(
    as_json: JsonFlag = False,
    quick: Annotated[bool, typer.Option(help="Two rounds per arm (about 4 min).")] = False,
) -> None:
    """Tracing and metrics on vs off: added TTFT p50 and throughput ON / OFF, side by side.

    Two `sluice serve` processes on tiny-llama, loaded in alternating rounds: OFF with
    SLUICE_METRICS_ENABLED=false and no OTEL_* variable; ON with metrics scraped every
    second and spans exported over OTLP/HTTP to a receiver run here, which counts them.
    """
    from benchmarks.observability import render, run

    emit(run(quick=quick), render, as_json)


@bench_app.command("faults")
def bench_faults(
    as_json: JsonFlag = False,
    requests: Annotated[int, typer.Option(help="Mixed requests per fault.")] = 1000,
    max_tokens: Annotated[int, typer.Option(help="Tokens each request asks for.")] = 16,
    only: Annotated[
        list[str] | None, typer.Option(help="Run only the faults whose name contains this.")
    ] = None,
) -> None:
    """One row per fault (kill -9s, Kafka, Redis and PostgreSQL outages, a gateway kill,
    a rolling restart of the engine workers, a broker kill -9 and restart on durable
    storage):
    requests sent, completed, failed with a clear error, lost, duplicated or missing
    tokens, and the ledger against the engine's usage.

    Runs `sluice up` fleets on a Tansu broker it starts, a Redis of its own and the
    PostgreSQL at $SLUICE_TEST_DATABASE_URL (a scratch database per fault); the broker
    restart's Tansu keeps its data in an s3rver bucket (node and npm; s3rver is installed
    into $SLUICE_S3RVER_DIR, default ~/.cache/sluice/s3rver, on first use).
    """
    from benchmarks.faults import render, run

    emit(run(total=requests, max_tokens=max_tokens, only=only), render, as_json)


@bench_app.command("money")
def bench_money(
    as_json: JsonFlag = False,
    quick: Annotated[
        bool, typer.Option(help="Fewer requests per scenario, the same scenarios.")
    ] = False,
    only: Annotated[
        list[str] | None, typer.Option(help="Run only the scenarios whose name contains this.")
    ] = None,
    fleet: Annotated[
        bool, typer.Option(help="Also the Kafka fleet's scenarios (needs PostgreSQL, Redis).")
    ] = True,
) -> None:
    """Σ ledger against Σ usage the client was shown, one row per scenario: plain chat and
    completions, n = 4, streams cancelled by disconnect, batches completed, cancelled and
    expired, `sluice bulk` (against the engine's usage), a kill -9 of the engine process;
    on Kafka a kill -9 of an engine worker and of the gateway. Goal: difference 0.

    Starts `sluice serve` (tiny-llama) and, with --fleet, a `sluice up` fleet on a Tansu
    broker, a Redis of its own and the PostgreSQL at $SLUICE_TEST_DATABASE_URL.
    """
    from benchmarks.money import render, run

    emit(run(quick=quick, only=only, fleet=fleet), render, as_json)


@bench_app.command("lora")
def bench_lora(
    as_json: JsonFlag = False,
    quick: Annotated[bool, typer.Option(help="The smaller mixed workload, one rep.")] = False,
    model: Annotated[
        str | None,
        typer.Option(help="A Hugging Face model directory.", show_default="h512 L8 preset"),
    ] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32, the same on every side.")] = (
        "bfloat16"
    ),
    reps: Annotated[
        int | None, typer.Option(help="Interleaved reps of the three arms.", show_default="3")
    ] = None,
    data_dir: DataDir = None,
) -> None:
    """Four LoRA adapters batched in one engine vs the base model alone (goal >= 0.8x its
    tokens/s) and vs four merged-weight engines time-sliced, on the mixed workload.

    Needs peft and transformers, from the project's test extra.
    """
    settings = settings_or_exit(Settings, data_dir=data_dir)
    try:
        from benchmarks.lora import render, run
    except ImportError as exc:
        typer.echo(f"bench lora needs the test extra: pip install -e '.[test]' ({exc})", err=True)
        raise typer.Exit(2) from exc
    result = run(quick=quick, model=model, dtype=dtype, data_dir=str(settings.data_dir), reps=reps)
    emit(result, render, as_json)


@bench_app.command("structured")
def bench_structured(
    as_json: JsonFlag = False,
    quick: Annotated[bool, typer.Option(help="The smaller mixed workload, one rep.")] = False,
    model: Annotated[
        str | None,
        typer.Option(
            help="A preset name, a Hugging Face model directory or a .gguf file.",
            show_default="smollm2-135m-instruct",
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32.")] = "bfloat16",
    requests: Annotated[
        int | None, typer.Option(help="Only the first N requests of the workload (a smoke run).")
    ] = None,
    vllm: Annotated[
        bool, typer.Option(help="Add vLLM's CPU build, installed by `scripts/peers vllm`.")
    ] = False,
    data_dir: DataDir = None,
) -> None:
    """JSON-schema constraints in Sluice's engine: the mixed workload with every request
    under a schema of the suite beside it unconstrained (tokens/s ratio, goal >= 0.95x),
    the share of outputs that validate (goal: all that finished), and grammar compile
    time p50/p99, cold and cached.

    Needs jsonschema, from the project's test extra.
    """
    settings = settings_or_exit(Settings, data_dir=data_dir)
    from benchmarks.structured import render, run

    result = run(
        quick=quick,
        model=model,
        dtype=dtype,
        data_dir=str(settings.data_dir),
        vllm=vllm,
        requests=requests,
    )
    emit(result, render, as_json)
