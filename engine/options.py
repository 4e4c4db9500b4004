"""`EngineOptions`: how the engine runs on this host, beside what it computes (`EngineConfig`).

The one home of the engine's runtime options: native kernels, prepacking, upcasting,
the kernel cache, the engine thread's nice value and cores, torch's thread counts and the
serving process's GIL switch interval. Each default is written here once; `sluice.settings`
derives its `SLUICE_*` defaults from `EngineOptions()` and the composition root builds
one from the settings. Nothing in `engine` reads the environment.

Two kinds of option: the backend takes the whole record (its engine thread's nice value
and cores, the runner's prepacking and upcasting); the process-wide ones (torch threads,
the kernels' library) are applied by a composition root with
`engine.backends.torch_backend.apply_process_options`, never by a builder or a backend.
No torch at import: the gateway reads this module too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """`EngineOptions()` is how `sluice` serves; tests and benchmarks override fields."""

    # the native CPU decode kernels (`engine.kernels`); False keeps the torch path
    kernels: bool = True
    # where the kernels' shared library is built and cached; None: ~/.cache/sluice/kernels
    kernel_cache_dir: Path | None = None
    # below this many multiply-adds a kernel runs on the calling thread alone (sharing
    # chunks with helper threads costs more than it saves)
    kernel_parallel_min_work: int = 256 << 10
    # oneDNN prepacking of the projections on CPU; False for comparisons
    prepack: bool = True
    # compute a bf16/fp16 model in fp32 on a CPU that only emulates bf16/fp16 (emulated
    # matmuls are several times slower); False keeps the emulated dtype, for comparisons
    cpu_upcast: bool = True
    # torch's intra-op threads in the engine's process; None leaves torch's default
    torch_threads: int | None = None
    # torch's threads for a step of at least `prefill_min_tokens` tokens (on CPU): its
    # GEMMs are long enough that more threads pay for their barriers even when another
    # process takes a core now and then, where short decode steps lose. None:
    # `torch_threads` for every step.
    prefill_threads: int | None = None
    prefill_min_tokens: int = 256
    # The engine thread's nice value, applied as it starts when torch computes on that
    # thread alone: a busy engine then yields its core to the threads that move requests
    # and tokens (the worker's loop, the Kafka clients), and takes every cycle they
    # leave. None leaves its priority alone.
    thread_nice: int | None = 10
    # the cores of the engine's threads (its thread, or its whole process); None: where
    # it started (`engine.cpus`)
    cpus: frozenset[int] | None = None
    # The serving process's GIL switch interval: at CPython's 5 ms default an engine
    # thread waits for the GIL behind the Kafka clients' threads at every step. None
    # leaves the interpreter's setting.
    gil_switch_interval_s: float | None = 0.0005


def apply_switch_interval(options: EngineOptions) -> None:
    """The serving process's GIL switch interval (process-wide: composition roots only)."""
    if options.gil_switch_interval_s is not None:
        sys.setswitchinterval(options.gil_switch_interval_s)
