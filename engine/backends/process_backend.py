"""`ProcessEngineBackend`: the torch engine in a process of its own, behind `EngineBackend`.

Why: in one process the engine thread shares the GIL with whatever else runs there (the
engine worker's asyncio loop and Kafka clients, or a gateway). Torch releases the GIL
inside each op and takes it back after, hundreds of times per step; each time another
thread holds it, the engine waits. Measured at saturation on the 2-core VM (tiny-llama,
engine pinned to its own core, `sluice bench serving`'s 160 req/s point): the worker's
engine thread held the CPU for 0.86 of each step's wall time against 0.97 for the same
engine with nothing else in its process, and delivered 0.79-0.85 of its tokens/s. vLLM's
V1 engine runs its EngineCore in a separate process from the API server for the same
reason: the Python work around the engine no longer competes with it for the GIL.

How: `start()` spawns the process, which loads the model (`TorchEngineBackend`, its
engine thread as usual) and says it is ready. Commands go down one pipe (`add`, `abort`,
`stop`); each engine step comes back up another as one message (the step's deltas and
the engine's stats after it), read by a thread here and handed to the asyncio loop like
`TorchEngineBackend` does. The contract is the same: one terminal delta per request;
if the process dies (killed, crashed) every request it held ends with 'error', `deltas()`
ends and `health()` turns False; `shutdown` ends what it holds with 'abort'. If this
process dies, the engine process sees its command pipe close and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.backends.base import (
    DeltaChannel,
    EngineDeadError,
    EngineDelta,
    EngineRequest,
    EngineStats,
    FinishReason,
    check_request,
    terminal_delta,
)
from engine.config import EngineConfig

logger = logging.getLogger(__name__)

# (kind, deltas, stats, adds received): kind is "ready" (deltas: the engine's config),
# "failed" (deltas: the error), "step" or "end"
_Event = tuple[str, Any, EngineStats | None, int]


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the engine process loads (`TorchEngineBackend.from_model`'s arguments)."""

    model: str | Path
    config: EngineConfig
    data_dir: str | Path | None = None
    quantization: str | None = None
    torch_threads: int | None = None


class ProcessEngineBackend:
    """See the module docstring. `thread_cpus` and `thread_nice` apply to the engine
    process (all its threads) when set before `start()`."""

    def __init__(self, spec: EngineSpec, *, start_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.config = spec.config  # the engine's own once it is ready
        self.tokenizer: Any = None  # the gateway side loads its own
        self.thread_cpus: frozenset[int] | None = None
        self.thread_nice: int | None = None
        self.start_timeout_s = start_timeout_s
        self._channel = DeltaChannel()
        self._lock = threading.Lock()  # commands pipe (None once closed), in-flight ids
        self._process: Any = None
        self._commands: Connection | None = None
        self._reader: threading.Thread | None = None
        self._inflight: set[str] = set()
        self._sent = 0  # adds sent; the engine process reports how many it received
        self._received = 0
        self._stats = EngineStats()
        self._stopping = False
        self._error: str | None = None

    # -- lifecycle -------------------------------------------------------------------
    def start(self, loop: Any = None) -> None:
        """Spawn the engine process and wait until its model is loaded."""
        if self._process is not None:
            raise RuntimeError("engine already started")
        self._channel.open(loop)
        ctx = mp.get_context("spawn")
        commands_in, commands = ctx.Pipe(duplex=False)
        events, events_out = ctx.Pipe(duplex=False)
        level = logging.getLogger().getEffectiveLevel()  # this process's, for the engine's
        args = (self.spec, commands_in, events_out, self.thread_cpus, self.thread_nice, level)
        process = ctx.Process(target=_engine_main, args=args, name="sluice-engine", daemon=True)
        process.start()
        commands_in.close()
        events_out.close()
        self._process, self._commands = process, commands
        kind = "failed"
        info: Any = f"no answer within {self.start_timeout_s:.0f}s"
        stats: EngineStats | None = None
        try:
            if events.poll(self.start_timeout_s):
                kind, info, stats, _ = events.recv()
        except (EOFError, OSError):
            info = f"exited with code {_exit_code(process)}"
        if kind != "ready":
            process.kill()
            process.join(5.0)
            self._commands = None
            commands.close()
            events.close()
            self._channel.post(None)
            raise EngineDeadError(f"engine process failed to start: {info}")
        assert isinstance(info, EngineConfig) and stats is not None
        self.config, self._stats = info, stats
        self._reader = threading.Thread(
            target=self._read, args=(events,), name="sluice-engine-reader", daemon=True
        )
        self._reader.start()
        logger.info("engine process pid=%s ready", process.pid)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._send(("stop", None))
        if self._reader is not None:
            self._reader.join(timeout_s)
        process = self._process
        if process is not None:
            process.join(timeout_s)
            if process.is_alive():
                logger.warning("engine process did not stop within %.1fs; killed", timeout_s)
                process.kill()
                process.join(5.0)

    def health(self) -> bool:
        process = self._process
        return (
            process is not None
            and process.is_alive()
            and self._commands is not None
            and not self._stopping
            and self._error is None
        )

    @property
    def error(self) -> str | None:
        """Why the engine process went away, if it died."""
        return self._error

    # -- requests in -----------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        check_request(request, self.config.max_model_len)
        with self._lock:
            if self._stopping or self._commands is None:
                raise EngineDeadError("engine is not running")
            if not self._send(("add", request)):
                raise EngineDeadError("engine process is gone")
            self._inflight.add(request.request_id)
            self._sent += 1

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._send(("abort", request_id))

    def _send(self, command: tuple[str, Any]) -> bool:
        """Under `_lock`. False when the engine process is gone."""
        if self._commands is None:
            return False
        try:
            self._commands.send(command)
        except OSError:  # a broken pipe: the reader thread reports the death
            return False
        return True

    # -- deltas out ------------------------------------------------------------------
    def deltas(self) -> AsyncIterator[list[EngineDelta]]:
        return self._channel.stream()

    def stats(self) -> EngineStats:
        stats, in_pipe = self._stats, self._sent - self._received
        if in_pipe <= 0:
            return stats
        return dataclasses.replace(stats, num_pending=stats.num_pending + in_pipe)

    def _read(self, events: Connection) -> None:
        """The reader thread: each step's deltas to the asyncio loop, in order."""
        ended = False
        try:
            while not ended:
                kind, deltas, stats, received = events.recv()
                if stats is not None:
                    self._stats, self._received = stats, received
                if deltas:
                    with self._lock:
                        for delta in deltas:
                            if delta.finish_reason is not None:
                                self._inflight.discard(delta.request_id)
                    self._channel.post(deltas)
                ended = kind == "end"
        except Exception as exc:  # EOF: the process went away without ending the stream
            if not isinstance(exc, EOFError | OSError):
                logger.exception("engine process events unreadable")
            if not self._stopping:
                self._error = f"engine process exited with code {_exit_code(self._process)}"
                logger.error("%s; its requests end with 'error'", self._error)
        finally:
            self._end(events)

    def _end(self, events: Connection) -> None:
        """No more steps: a request sent but never ended (an add that crossed the engine's
        death, or a process that died or stopped without its terminal deltas) ends now,
        'abort' when this side stopped it, else 'error'; then `deltas()` ends."""
        with self._lock:
            if self._commands is not None:
                self._commands.close()
                self._commands = None
            lost, self._inflight = sorted(self._inflight), set()
        events.close()
        if lost:
            reason: FinishReason = "abort" if self._stopping else "error"
            error = None if self._stopping else (self._error or "the engine stopped")
            self._channel.post([EngineDelta(r, finish_reason=reason, error=error) for r in lost])
        self._channel.post(None)


def _exit_code(process: Any) -> int | None:
    if process is None:
        return None
    process.join(1.0)
    code: int | None = process.exitcode
    return code


def _engine_main(
    spec: EngineSpec,
    commands: Connection,
    events: Connection,
    cpus: frozenset[int] | None,
    nice: int | None,
    log_level: int = logging.INFO,
) -> None:
    """The engine process: load, say ready, then serve commands until `stop` or EOF."""
    # Ctrl-C reaches every process of the terminal's group: the parent drains (its
    # requests finish, then it sends `stop`), so this one must not die first. SIGTERM
    # keeps its default: multiprocessing terminates daemonic children with it at exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine] %(message)s"
    )
    from engine.backends.torch_backend import TorchEngineBackend
    from engine.cpus import pin_process

    if cpus:
        pin_process(cpus)
    if spec.torch_threads:
        import torch

        torch.set_num_threads(spec.torch_threads)
    try:
        backend = TorchEngineBackend.from_model(
            spec.model, config=spec.config, data_dir=spec.data_dir, quantization=spec.quantization
        )
    except Exception as exc:
        events.send(("failed", f"{type(exc).__name__}: {exc}", None, 0))
        return
    # its first-token pause lets an asyncio loop of the same process take the GIL at
    # once; there is none here (the reader is in the other process)
    backend.first_token_yield_s = 0.0
    backend.thread_nice = nice
    received = 0
    send_lock = threading.Lock()

    def send_step(batch: list[EngineDelta] | None) -> None:  # on the engine thread
        event: _Event = ("end" if batch is None else "step", batch, backend.stats(), received)
        # OSError: the parent is gone; the command pipe's EOF stops this process
        with send_lock, contextlib.suppress(OSError):
            events.send(event)

    events.send(("ready", backend.config, backend.stats(), 0))
    backend.start(sink=send_step)  # from here on only the engine thread sends events
    while True:
        try:
            kind, payload = commands.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if kind == "add":
            received += 1
            try:
                backend.submit(payload)
            except EngineDeadError:
                pass  # the engine loop died: the parent ends what it sent after 'end'
            except Exception as exc:  # checked in the parent already; never lose one
                logger.warning("request_id=%s rejected: %s", payload.request_id, exc)
                send_step([terminal_delta(payload, "error", str(exc))])
        elif kind == "abort":
            backend.abort(payload)
        else:
            break
    # the parent kills this process if it takes too long; a step in flight may be slow
    backend.shutdown(300.0)
