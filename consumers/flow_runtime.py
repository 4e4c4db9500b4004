"""What the request flow's parts share: the worker's bus, engine, stats, mode and tasks.

The parts of `consumers.engine_flow` (starts, answers, orphans, endings, cancels,
output) all run on the engine worker's event loop thread, so they share these plainly,
without locks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

from sluice.bus.base import EventBus
from sluice.bus.messages import GenerateRequest
from sluice.consumers.progress import ProgressStore
from sluice.consumers.work_item import WorkItem
from sluice.engine.backends.base import EngineBackend

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FlowMode:
    """The worker's switches that the flow's parts read; the worker sets them."""

    stopping: bool = False  # draining: admit nothing more
    engine_up: bool = True  # False while the worker restarts a dead engine
    # the engine has been down longer than `engine_wait_s`: polled requests are answered
    # 503 at once (their partitions no longer paused for the restart)
    engine_unavailable: bool = False
    restarts_engine: bool = False  # the worker restarts a dead engine (it can)

    @property
    def waits_for_restart(self) -> bool:
        """Whether a request the engine died under may wait for the engine's restart."""
        return self.restarts_engine and not self.stopping


class FlowStats(Protocol):
    """The counters of `consumers.engine_worker.WorkerStats` the flow keeps."""

    healthy: bool
    buffered: int
    in_engine: int
    held: int
    received: int
    finished: int
    cancelled: int
    dead_lettered: int
    fenced: int


class FlowTasks:
    """The tasks the flow spawns on the loop, kept until done; one that fails is logged."""

    def __init__(self, worker_id: str) -> None:
        self._worker_id = worker_id
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def wait(self, timeout_s: float) -> None:
        """Until the tasks spawned so far are done, or `timeout_s` passed."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("worker=%s task failed", self._worker_id, exc_info=task.exception())


@dataclass(frozen=True, slots=True)
class FlowEnv:
    """The worker's things the flow's parts use: its bus and engine, its progress store
    and the executor that calls it, its stats, mode and the tasks spawned on its loop."""

    bus: EventBus
    backend: EngineBackend
    progress: ProgressStore
    io: Executor
    worker_id: str
    stats: FlowStats
    mode: FlowMode
    tasks: FlowTasks


def ids(obj: WorkItem | GenerateRequest) -> tuple[str, str]:
    """A request's id and tenant, as every log line of the flow names them."""
    return obj.request_id, obj.tenant_id
