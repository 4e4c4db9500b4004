"""`ProcessEngineBackend`: the torch engine in a process of its own, behind `EngineBackend`.

Why: in one process the engine thread shares the GIL with whatever else runs there (the
engine worker's asyncio loop and Kafka clients, or a gateway). Torch releases the GIL
inside each op and takes it back after, hundreds of times per step; each time another
thread holds it, the engine waits, a measurable share of each step at saturation. vLLM's
V1 engine runs its EngineCore in a separate process from the API server for the same
reason: the Python work around the engine does not compete with it for the GIL.

How: `start()` spawns the process, which loads the model (`TorchEngineBackend`, its
engine thread as usual) and says it is ready. Commands go down one pipe (`AddRequest`,
`AbortRequest`, `StopEngine`); each engine step comes back up another as one
`StepCompleted` (the step's deltas and the engine's stats after it), read by a thread
here and handed to the asyncio loop like `TorchEngineBackend` does. Every message is a
dataclass of `engine.backends.ipc`; each side dispatches with `match` on its class (a
few kinds per side, and mypy narrows each case). The contract is the same: one
terminal delta per request; if the process dies (killed, crashed) every request it held
ends with 'error' (marked `retryable`), `deltas()` ends and `health()` turns False;
`shutdown` ends what it holds with 'abort'. If this process dies, the engine process
sees its command pipe close and exits. After a death, `restart()` spawns a fresh engine
process (the engine worker does, with backoff, and resubmits what the dead one held).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

from sluice.engine.backends.base import (
    DeltaChannel,
    EngineDeadError,
    EngineDelta,
    EngineRequest,
    EngineStats,
    FinishReason,
    check_request,
    terminal_delta,
)
from sluice.engine.backends.ipc import (
    AbortRequest,
    AddRequest,
    Command,
    EngineReady,
    EngineSpec,
    EngineStopped,
    StartFailed,
    StepCompleted,
    StopEngine,
)

__all__ = ["EngineSpec", "ProcessEngineBackend"]

logger = logging.getLogger(__name__)


class ProcessEngineBackend:
    """See the module docstring. The engine process runs as `spec.options` say (its
    cores, torch threads, kernels, the engine thread's nice value)."""

    def __init__(self, spec: EngineSpec, *, start_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.config = spec.config  # the engine's own once it is ready
        self.vocab_size: int | None = None  # the model's, once it is ready
        self.tokenizer: Any = None  # the gateway side loads its own
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

    def attach(self, channel: Any) -> None:
        """Post each step to `channel` (`open(loop)`, `post(batch)`) instead of this
        backend's own `deltas()` stream: `ReplicatedBackend` merges its replicas'."""
        self._channel = channel

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
        args = (self.spec, commands_in, events_out, level)
        process = ctx.Process(target=_engine_main, args=args, name="sluice-engine", daemon=True)
        process.start()
        commands_in.close()
        events_out.close()
        self._process, self._commands = process, commands
        ready: EngineReady | None = None
        failure = f"no answer within {self.start_timeout_s:.0f}s"
        try:
            if events.poll(self.start_timeout_s):
                match events.recv():
                    case EngineReady() as ready:
                        pass
                    case StartFailed(error):
                        failure = error
        except (EOFError, OSError):
            failure = f"exited with code {_exit_code(process)}"
        if ready is None:
            process.kill()
            process.join(5.0)
            self._commands = None
            commands.close()
            events.close()
            self._channel.post(None)
            raise EngineDeadError(f"engine process failed to start: {failure}")
        self.config, self.vocab_size, self._stats = ready.config, ready.vocab_size, ready.stats
        self._reader = threading.Thread(
            target=self._read, args=(events,), name="sluice-engine-reader", daemon=True
        )
        self._reader.start()
        logger.info("engine process pid=%s ready", process.pid)

    def restart(self, loop: Any = None) -> None:
        """Spawn a fresh engine process after this one died (`deltas()` has ended) and
        wait until its model is loaded; `deltas()` is then a new stream. Raises
        EngineDeadError when it fails to start or this backend was shut down."""
        with self._lock:
            if self._stopping:
                raise EngineDeadError("engine is shut down")
            if self._commands is not None:
                raise RuntimeError("the engine process is still running")
        if self._reader is not None:
            self._reader.join()  # it ended the old stream; joins at once
        old = self._process
        if old is not None and old.is_alive():  # an exit already under way
            old.kill()
        if old is not None:
            old.join(5.0)
        self._process = self._reader = None
        self._inflight, self._sent, self._received = set(), 0, 0
        self._error = None
        self.start(loop)

    @property
    def pid(self) -> int | None:
        """The engine process's id while it runs (for operators and fault tests)."""
        process = self._process
        return None if process is None else process.pid

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._send(StopEngine())
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
        check_request(request, self.config.max_model_len, self.vocab_size)
        with self._lock:
            if self._stopping or self._commands is None:
                raise EngineDeadError("engine is not running")
            if not self._send(AddRequest(request)):
                raise EngineDeadError("engine process is gone")
            self._inflight.add(request.request_id)
            self._sent += 1

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._send(AbortRequest(request_id))

    def _send(self, command: Command) -> bool:
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
        try:
            while True:
                match events.recv():
                    case StepCompleted(deltas, stats, num_received):
                        self._stats, self._received = stats, num_received
                        self._deliver(deltas)
                    case EngineStopped(stats, num_received):
                        self._stats, self._received = stats, num_received
                        break
                    case other:
                        raise TypeError(f"unexpected engine event {other!r}")
        except Exception as exc:  # EOF: the process went away without ending the stream
            if not isinstance(exc, EOFError | OSError):
                logger.exception("engine process events unreadable")
            if not self._stopping:
                self._error = f"engine process exited with code {_exit_code(self._process)}"
                logger.error("%s; its requests end with 'error'", self._error)
        finally:
            self._end(events)

    def _deliver(self, deltas: list[EngineDelta]) -> None:
        if not deltas:
            return
        with self._lock:
            for delta in deltas:
                if delta.finish_reason is not None:
                    self._inflight.discard(delta.request_id)
        self._channel.post(deltas)

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
            died = not self._stopping
            reason: FinishReason = "error" if died else "abort"
            error = (self._error or "the engine stopped") if died else None
            self._channel.post(
                [EngineDelta(r, finish_reason=reason, error=error, retryable=died) for r in lost]
            )
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
    log_level: int = logging.INFO,
) -> None:
    """The engine process: load, say ready, then serve commands until `stop` or EOF.

    This is the engine process's composition root: it applies the process-wide options
    (cores, torch threads, kernels) to itself, as `sluice.wiring` does for a serving
    process."""
    # Ctrl-C reaches every process of the terminal's group: the parent drains (its
    # requests finish, then it sends `stop`), so this one must not die first. SIGTERM
    # keeps its default: multiprocessing terminates daemonic children with it at exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine] %(message)s"
    )
    from sluice.engine.backends.torch_backend import TorchEngineBackend, apply_process_options
    from sluice.engine.cpus import pin_process

    options = spec.options
    if options.cpus:
        pin_process(options.cpus)
    apply_process_options(options)
    try:
        backend = TorchEngineBackend.from_model(
            spec.model,
            config=spec.config,
            data_dir=spec.data_dir,
            quantization=spec.quantization,
            options=options,
        )
    except Exception as exc:
        events.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    # its first-token pause lets an asyncio loop of the same process take the GIL at
    # once; there is none here (the reader is in the other process)
    backend.first_token_yield_s = 0.0
    received = 0
    send_lock = threading.Lock()

    def send_step(batch: list[EngineDelta] | None) -> None:  # on the engine thread
        stats = backend.stats()
        event = (
            EngineStopped(stats, received)
            if batch is None
            else StepCompleted(batch, stats, received)
        )
        # OSError: the parent is gone; the command pipe's EOF stops this process
        with send_lock, contextlib.suppress(OSError):
            events.send(event)

    events.send(EngineReady(backend.config, backend.vocab_size, backend.stats()))
    backend.start(sink=send_step)  # from here on only the engine thread sends events
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        match command:
            case AddRequest(request):
                received += 1
                try:
                    backend.submit(request)
                except EngineDeadError:
                    pass  # the engine loop died: the parent ends what it sent after the end
                except Exception as exc:  # checked in the parent already; never lose one
                    logger.warning("request_id=%s rejected: %s", request.request_id, exc)
                    send_step([terminal_delta(request, "error", str(exc))])
            case AbortRequest(request_id):
                backend.abort(request_id)
            case _:  # StopEngine (anything else stops too)
                break
    # the parent kills this process if it takes too long; a step in flight may be slow
    backend.shutdown(300.0)
