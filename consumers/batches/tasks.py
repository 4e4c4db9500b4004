"""Celery runs the batch lifecycle: one task per step of `BatchRunner`, plus beat's sweep.

Every task is idempotent (the runner's steps are compare-and-set on the store), acked
late and rejected when its worker is lost, so a task whose worker died is delivered
again and a redelivered one changes nothing. Distributed: a Redis broker, `sluice worker
batches` (these tasks and the collector) and `sluice worker batches-beat` (the sweep
every `SLUICE_BATCH_SWEEP_S`). Embedded: `InProcessBatches` applies the same tasks in a
thread of `sluice serve` (docs/architecture.md §14).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import Celery

from sluice.api.routes.batches import BatchLimits
from sluice.consumers.batches.collector import BatchCollector
from sluice.consumers.batches.runner import BatchRunner
from sluice.storage.batches import BatchInfo, BatchStore

logger = logging.getLogger(__name__)

QUEUE = "sluice.batches"
VALIDATE, CANCEL, FINALIZE, SWEEP = (
    "sluice.batches.validate",
    "sluice.batches.cancel",
    "sluice.batches.finalize",
    "sluice.batches.sweep",
)


def make_celery(broker_url: str | None, *, sweep_interval_s: float = 10.0) -> Celery:
    """The Celery app of the batch tasks; `runner` is bound where tasks execute."""
    app = Celery("sluice.batches", broker=broker_url or "memory://", set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=QUEUE,
        task_ignore_result=True,
        # a task unacked this long is delivered again: longer than any step takes
        broker_transport_options={"visibility_timeout": 900},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # a sweep not picked up before the next one is due is dropped, not piled up
        beat_schedule={
            "sweep": {
                "task": SWEEP,
                "schedule": sweep_interval_s,
                "options": {"expires": sweep_interval_s},
            }
        },
    )
    holder: dict[str, BatchRunner] = {}
    app.conf.sluice_runner = holder
    # shared=False: a shared task is added to every app made later in the process, where
    # it would run the first app's runner

    def runner() -> BatchRunner:
        bound = holder.get("runner")
        if bound is None:
            raise RuntimeError("no BatchRunner bound to this Celery app (bind_runner)")
        return bound

    @app.task(name=VALIDATE, shared=False)  # type: ignore[untyped-decorator]
    def validate(batch_id: str) -> None:
        runner().validate(batch_id)

    @app.task(name=CANCEL, shared=False)  # type: ignore[untyped-decorator]
    def cancel(batch_id: str) -> None:
        runner().cancel(batch_id)

    @app.task(name=FINALIZE, shared=False)  # type: ignore[untyped-decorator]
    def finalize(batch_id: str) -> None:
        runner().finalize(batch_id)

    @app.task(name=SWEEP, shared=False)  # type: ignore[untyped-decorator]
    def sweep() -> None:
        runner().sweep()

    return app


def bind_runner(app: Celery, runner: BatchRunner) -> None:
    app.conf.sluice_runner["runner"] = runner


class CeleryBatches:
    """The gateway's `BatchControl` in distributed mode: steps go to the Celery broker."""

    def __init__(self, app: Celery, store: BatchStore, limits: BatchLimits) -> None:
        self.app = app
        self.store = store
        self.limits = limits

    def submitted(self, batch: BatchInfo) -> None:
        self.app.send_task(VALIDATE, args=[batch.id], queue=QUEUE)

    def cancel_requested(self, batch: BatchInfo) -> None:
        self.app.send_task(CANCEL, args=[batch.id], queue=QUEUE)

    def batch_done(self, batch_id: str) -> None:
        self.app.send_task(FINALIZE, args=[batch_id], queue=QUEUE)


class InProcessBatches:
    """Embedded mode's `BatchControl`: the same tasks, applied in one thread of this
    process, the collector in another, and beat's sweep in a third."""

    def __init__(
        self,
        runner: BatchRunner,
        limits: BatchLimits,
        *,
        sweep_interval_s: float = 5.0,
        recover_on_start: bool = True,
        engine_ready: Callable[[], bool] | None = None,
    ) -> None:
        self.runner = runner
        self.store = runner.store
        self.limits = limits
        self.app = make_celery(None, sweep_interval_s=sweep_interval_s)
        bind_runner(self.app, runner)
        self.sweep_interval_s = sweep_interval_s
        self.recover_on_start = recover_on_start
        # the in-memory bus keeps a partition's unread records only for groups that have
        # joined: lines published before the engine worker's group exists could be
        # trimmed, so no step runs until this process's engine worker is ready
        self._engine_ready = engine_ready
        self.collector = BatchCollector(
            runner.bus, runner.store, runner.models, self.batch_done, budget=runner.budget
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="sluice-batch-task")
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def _wait_for_engine(self) -> None:
        while self._engine_ready is not None and not self._engine_ready():
            if self._stopping.wait(0.1):
                return
        self._engine_ready = None  # once: later restarts keep the group, and its records

    def _apply(self, name: str, *args: Any) -> None:
        task = self.app.tasks[name]

        def run() -> None:
            self._wait_for_engine()
            result = task.apply(args=args)
            if result.failed():
                logger.error("batch task %s%s failed: %s", name, args, result.result)

        self._executor.submit(run)

    def submitted(self, batch: BatchInfo) -> None:
        self._apply(VALIDATE, batch.id)

    def cancel_requested(self, batch: BatchInfo) -> None:
        self._apply(CANCEL, batch.id)

    def batch_done(self, batch_id: str) -> None:
        self._apply(FINALIZE, batch_id)

    def start(self) -> InProcessBatches:
        if self.recover_on_start:

            def recover() -> None:
                self._wait_for_engine()
                self.runner.recover_after_restart()

            self._executor.submit(recover)
        self._threads = [
            threading.Thread(
                target=self.collector.run, name="sluice-batches-collector", daemon=True
            ),
            threading.Thread(target=self._beat, name="sluice-batches-beat", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def _beat(self) -> None:
        while not self._stopping.wait(self.sweep_interval_s):
            self._apply(SWEEP)

    def stop(self) -> None:
        self._stopping.set()
        self.collector.stop()
        for thread in self._threads:
            thread.join(5.0)
        self._executor.shutdown(wait=False, cancel_futures=True)
