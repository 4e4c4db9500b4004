"""Which cores the engine's threads run on, and keeping everything else off them.

On CPU the engine's step thread (and torch's threads under it) may need to own its cores:
with everything else of the host free to run anywhere, a saturated engine thread spends
part of its time runnable but waiting for its core. vLLM's CPU backend binds its OpenMP
threads to cores for the same reason (`VLLM_CPU_OMP_THREADS_BIND`), leaving cores to the
serving front end.

Linux only (`os.sched_setaffinity`); elsewhere nothing is pinned.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CpuLayout:
    """The engine's cores and the cores of everything else; disjoint, neither empty."""

    engine: frozenset[int]
    rest: frozenset[int]

    def describe(self) -> str:
        return f"engine on cpus {format_cpus(self.engine)}, the rest on {format_cpus(self.rest)}"


def parse_cpus(spec: str) -> frozenset[int]:
    """'1-3,5' → {1, 2, 3, 5}; ValueError on anything else."""
    cpus: set[int] = set()
    for part in spec.replace(" ", "").split(","):
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"expected a cpu list such as '1-3,5', got {spec!r}")
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise ValueError(f"cpu range {part!r} runs backwards")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def available_cpus() -> frozenset[int]:
    """The cores this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def plan_layout(spec: str | None, engine_threads: int) -> CpuLayout | None:
    """`spec`: None or 'none' (no pinning), 'auto' (the last `engine_threads` of this
    process's cores for the engine) or a cpu list. None also where it would leave nothing
    else a core, or on a system without affinity."""
    if spec is None or spec == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = available_cpus()
    if spec == "auto":
        engine = frozenset(sorted(cpus)[-engine_threads:]) if engine_threads > 0 else frozenset()
    else:
        engine = parse_cpus(spec) & cpus
    rest = cpus - engine
    if not engine or not rest:
        logger.warning(
            "engine cpus %r leave %s for the engine and %s for the rest: not pinning",
            spec,
            format_cpus(engine) or "nothing",
            format_cpus(rest) or "nothing",
        )
        return None
    return CpuLayout(engine, rest)


def pin_this_thread(cpus: frozenset[int]) -> None:
    """The calling thread (and threads it starts later) runs on `cpus` only."""
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError) as exc:
        logger.info("thread not pinned to cpus %s: %s", format_cpus(cpus), exc)


def pin_process(cpus: frozenset[int], pid: int | None = None) -> None:
    """Every thread `pid` (default: this process) has now, and the threads they start
    later, runs on `cpus` only. A thread that ends meanwhile is skipped."""
    tasks = f"/proc/{pid or os.getpid()}/task"
    try:
        tids = [int(tid) for tid in os.listdir(tasks)]
    except OSError as exc:
        logger.info("process %s not pinned: %s", pid or os.getpid(), exc)
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except (AttributeError, ProcessLookupError):
            continue
        except OSError as exc:
            logger.info("thread %s not pinned to cpus %s: %s", tid, format_cpus(cpus), exc)
