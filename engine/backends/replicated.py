"""`ReplicatedBackend`: several engine processes behind one `EngineBackend` (data parallel).

Why: on a CPU host an engine step of a small model is compute-bound on one core, and its
threads share nothing but the weights they read. One engine with two threads splits each
GEMM between them and waits at every barrier for whichever thread lost its core to the
gateway; two engines with a thread each wait for nothing: each takes the cycles it gets.
vLLM offers the same split as its data-parallel size.

How: each replica is a `ProcessEngineBackend` with its own model copy and its own share of
the KV cache. `submit` sends a request to the replica holding the fewest unfinished ones
(a request never moves); `abort` goes where the request went; every replica's steps come
out of one `deltas()` stream, in order per request. The contract is the engine's: one
terminal delta per request. When a replica dies, its requests end with 'error'
(`retryable`) and `deltas()` ends once, as a single engine's would; the other replicas go
on, their steps queued for the next stream (read once the worker has restarted the dead:
their clients wait meanwhile). `restart()` starts the dead replicas again, and ends the
stream once more if another died meanwhile, after that one's requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from sluice.engine.backends.base import (
    DeltaChannel,
    EngineBackend,
    EngineDeadError,
    EngineDelta,
    EngineRequest,
    EngineStats,
)
from sluice.engine.backends.process_backend import EngineSpec, ProcessEngineBackend

__all__ = ["Replica", "ReplicatedBackend", "replica_specs"]


class Replica(EngineBackend, Protocol):
    """A backend that can post its steps to another's stream (`ProcessEngineBackend`, and
    `TorchEngineBackend` in tests); `restart(loop)` too where it can start again."""

    config: Any  # the engine's `EngineConfig` (its own once started)
    vocab_size: int | None

    def attach(self, channel: Any) -> None: ...


logger = logging.getLogger(__name__)


def replica_specs(spec: EngineSpec, replicas: int) -> list[EngineSpec]:
    """`spec` for each of `replicas` engines: the KV cache split between them (the
    configured size is the whole engine's)."""
    config = dataclasses.replace(spec.config, kv_cache_mb=spec.config.kv_cache_mb / replicas)
    return [dataclasses.replace(spec, config=config) for _ in range(replicas)]


class _ReplicaChannel:
    """What a replica posts its steps to: the replicated backend's bookkeeping, then its
    one stream (a `DeltaChannel` in the replica's place)."""

    def __init__(self, on_post: Callable[[list[EngineDelta] | None], None]) -> None:
        self.post = on_post

    def open(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        pass  # the replicated backend's channel is bound to the loop


class ReplicatedBackend:
    """See the module docstring. `replicas`: the engines, not started."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        if not replicas:
            raise ValueError("at least one replica")
        self.replicas = list(replicas)
        self.config = self.replicas[0].config
        self.vocab_size: int | None = None
        self.tokenizer: Any = None  # the gateway side loads its own
        self._channel = DeltaChannel()
        self._lock = threading.Lock()  # owners, counts, and the state below
        self._owner: dict[str, int] = {}  # request id -> replica index, until terminal
        self._counts = [0] * len(self.replicas)
        self._down: set[int] = set()  # replicas whose stream ended (dead or stopped)
        self._ends = [0] * len(self.replicas)  # each replica's stream ends so far
        self._ended = False  # `deltas()` was ended for a death; `restart` reopens it
        # replicas that died after that end: their requests' ends may follow it
        self._unannounced: set[int] = set()
        self._closed = False  # ... or for good, at shutdown
        self._stopping = False
        for i, replica in enumerate(self.replicas):
            replica.attach(_ReplicaChannel(functools.partial(self._on_post, i)))

    @classmethod
    def of(cls, spec: EngineSpec, replicas: int) -> ReplicatedBackend:
        return cls([ProcessEngineBackend(s) for s in replica_specs(spec, replicas)])

    # -- lifecycle -------------------------------------------------------------------
    def start(self, loop: Any = None) -> None:
        """Start every replica at once and wait until all are loaded; if one fails, stop
        the others and raise EngineDeadError."""
        self._channel.open(loop)
        try:
            self._start(list(range(len(self.replicas))), loop)
        except EngineDeadError:
            self.shutdown()
            raise
        first = self.replicas[0]
        self.config, self.vocab_size = first.config, first.vocab_size

    def _start(self, indices: list[int], loop: Any, *, restart: bool = False) -> None:
        def one(i: int) -> None:
            replica: Any = self.replicas[i]
            if not restart:
                replica.start(loop)
            elif hasattr(replica, "restart"):
                replica.restart(loop)
            else:
                raise EngineDeadError("this engine cannot start again")

        with self._lock:
            ends = {i: self._ends[i] for i in indices}
        with ThreadPoolExecutor(len(indices), thread_name_prefix="sluice-replica") as pool:
            futures = {i: pool.submit(one, i) for i in indices}
        failed = [(i, f.exception()) for i, f in futures.items() if f.exception() is not None]
        with self._lock:  # up, unless it died again since it started
            self._down.difference_update(
                i for i in indices if futures[i].exception() is None and self._ends[i] == ends[i]
            )
        if failed:
            i, exc = failed[0]
            raise EngineDeadError(f"engine replica {i} failed to start: {exc}") from exc

    def restart(self, loop: Any = None) -> None:
        """Start again the replicas that died; the others went on meanwhile. If one died
        after `deltas()` ended (during this restart too), the stream ends again, after
        that one's requests' deltas, for the worker to pick them up."""
        with self._lock:
            if self._stopping:
                raise EngineDeadError("engine is shut down")
            dead = sorted(self._down)
        if dead:
            self._start(dead, loop, restart=True)
        with self._lock:
            stopping = self._stopping
            again = bool(self._down or self._unannounced) and not stopping
            self._ended, self._unannounced = again, set()
        if stopping:  # shut down while these started
            for i in dead:
                self.replicas[i].shutdown()
        elif again:
            self._channel.post(None)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
        with ThreadPoolExecutor(len(self.replicas), thread_name_prefix="sluice-replica") as pool:
            for replica in self.replicas:
                pool.submit(replica.shutdown, timeout_s)
        with self._lock:  # every replica was down already, or one did not end in time
            end, self._closed = not self._closed, True
        if end:
            self._channel.post(None)

    def health(self) -> bool:
        return not self._stopping and all(r.health() for r in self.replicas)

    @property
    def error(self) -> str | None:
        """Why a replica went away, if one died."""
        errors = (getattr(r, "error", None) for r in self.replicas)
        return next((str(e) for e in errors if e), None)

    @property
    def pids(self) -> list[int | None]:
        """The replicas' engine process ids (for operators and fault tests)."""
        return [getattr(r, "pid", None) for r in self.replicas]

    # -- requests in -----------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        rid = request.request_id
        with self._lock:
            live = [i for i in range(len(self.replicas)) if i not in self._down]
            if self._stopping or not live:
                raise EngineDeadError("engine is not running")
            owner = self._owner.get(rid)
            if owner is None:
                i = min(live, key=self._counts.__getitem__)
                self._owner[rid] = i  # before the submit: its terminal delta may come at once
                self._counts[i] += 1
        if owner is not None:  # a duplicate: to where the first went, which ignores it
            self.replicas[owner].submit(request)
            return
        try:
            self.replicas[i].submit(request)
        except BaseException:
            self._release(rid)
            raise

    def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            self.replicas[i].abort(request_id)

    def _release(self, request_id: str) -> None:
        with self._lock:
            i = self._owner.pop(request_id, None)
            if i is not None:
                self._counts[i] -= 1

    # -- deltas out ------------------------------------------------------------------
    def deltas(self) -> AsyncIterator[list[EngineDelta]]:
        return self._channel.stream()

    def _on_post(self, i: int, batch: list[EngineDelta] | None) -> None:
        """From replica `i`'s reader thread: a step, or None when its stream ended."""
        if batch is not None:
            for delta in batch:
                if delta.finish_reason is not None:
                    self._release(delta.request_id)
            self._channel.post(batch)
            return
        with self._lock:
            self._down.add(i)
            self._ends[i] += 1
            if self._stopping:
                end = len(self._down) == len(self.replicas) and not self._closed
                self._closed = self._closed or end
            elif self._ended:  # `restart` ends the stream again after its requests' ends
                end = False
                self._unannounced.add(i)
            else:  # the first death since `restart` ends the stream; it restarts all
                end = self._ended = True
        if end:
            self._channel.post(None)

    def stats(self) -> EngineStats:
        parts = [r.stats() for r in self.replicas]
        blocks = sum(s.num_kv_blocks for s in parts)
        used = sum(s.kv_usage * s.num_kv_blocks for s in parts)
        total = {
            f.name: sum(getattr(s, f.name) for s in parts)
            for f in dataclasses.fields(EngineStats)
            if f.name != "kv_usage"
        }
        return EngineStats(kv_usage=used / blocks if blocks else 0.0, **total)
