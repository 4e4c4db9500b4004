"""One request the engine worker holds: its states, the transitions between them, why it ends.

Sits under `consumers.engine_flow`, which turns the worker's events (a polled record, a
cancel, an engine step, a confirmed publish, a rebalance, the engine's death) into the
transitions below; every change of `WorkItem.state` is one of these methods, and each
checks where it comes from (`IllegalTransition` is a bug, never a runtime condition):

    transition  from                                  to
    start       BUFFERED, ORPHANED                    STARTING
    begin       STARTING                              STARTING (its attempt's numbers)
    requeue     STARTING, ORPHANED                    BUFFERED
    run         STARTING                              RUNNING
    orphan      RUNNING, STARTING                     ORPHANED
    finishing   RUNNING, STARTING, ORPHANED           FINISHING
    done        FINISHING, STARTING, BUFFERED,        DONE
                ORPHANED

BUFFERED: in the admission buffer. STARTING: its attempt is being begun in the progress
store (to run, or to be answered without running). RUNNING: submitted to the engine.
ORPHANED: the engine process died under it and is being restarted; it goes back to the
buffer (`requeue`) or is answered (`start`, then `finishing`). FINISHING: its terminal
delta is built, its publishes not yet confirmed. DONE: its offset is released.

Why a request stops before it finishes on its own is one `EndReason` (`WorkItem.end`):
the finish reason its terminal delta carries, an error's detail, and whether the
client hears of it at all (`silent`: another member owns the request now).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from sluice.bus.base import TopicPartition
from sluice.bus.messages import GenerateRequest
from sluice.consumers.progress import AttemptStart
from sluice.engine.backends.base import FinishReason


def now_ms() -> int:
    return int(time.time() * 1000)


class ItemState(enum.Enum):
    BUFFERED = "buffered"  # in the local admission buffer
    STARTING = "starting"  # attempt being begun in the progress store
    RUNNING = "running"  # submitted to the engine
    ORPHANED = "orphaned"  # the engine died under it; waits for the restart
    FINISHING = "finishing"  # terminal delta built; publishes not yet confirmed
    DONE = "done"  # offset released; no longer held


class IllegalTransition(Exception):
    """A transition from a state it does not leave (a bug in the worker; permanent)."""

    retryable = False


class EndKind(enum.Enum):
    ABORTED = "aborted"  # cancelled (by request, tenant or batch)
    DEADLINE = "deadline"  # its deadline passed before it ran to the end
    LENGTH = "length"  # earlier attempts already generated max_tokens
    ERROR = "error"  # the engine refused it (`EndReason.detail` says why)
    # no engine came up to run it within `engine_wait_s` (`detail`: the cause and its fix)
    UNAVAILABLE = "unavailable"
    FINISHED = "finished"  # an earlier attempt published its terminal delta
    LOST = "lost"  # its partition went to another member, who answers it
    FENCED = "fenced"  # a newer attempt began elsewhere
    STOPPED = "stopped"  # the engine died for good; this worker stops uncommitted
    # still running at the drain's deadline: its offset stays uncommitted and the
    # partition's next owner resumes it from its recorded progress, as after a kill -9
    HANDED_OVER = "handed_over"


_SILENT = frozenset({EndKind.LOST, EndKind.FENCED, EndKind.STOPPED, EndKind.HANDED_OVER})
_FINISH_REASONS: dict[EndKind, FinishReason] = {
    EndKind.ABORTED: "abort",
    EndKind.DEADLINE: "deadline",
    EndKind.LENGTH: "length",
    EndKind.ERROR: "error",
    EndKind.UNAVAILABLE: "error",
    EndKind.LOST: "abort",
    EndKind.FENCED: "abort",
    EndKind.STOPPED: "abort",
    EndKind.HANDED_OVER: "abort",
}


@dataclass(frozen=True, slots=True)
class EndReason:
    """Why the worker ends a request before the engine finishes it on its own."""

    kind: EndKind
    detail: str | None = None  # ERROR: the engine's words (logged); UNAVAILABLE: shown

    @classmethod
    def error(cls, detail: str) -> EndReason:
        return cls(EndKind.ERROR, detail)

    @classmethod
    def unavailable(cls, detail: str) -> EndReason:
        return cls(EndKind.UNAVAILABLE, detail)

    @property
    def silent(self) -> bool:
        """No deltas, no progress: another member answers the request now (usage is still
        published, but for a hand-over: `WorkItem.handed_over`)."""
        return self.kind in _SILENT

    @property
    def finish_reason(self) -> FinishReason:
        """What the worker's terminal engine delta says (`engine_outputs.unrun_terminal`;
        mapped to the bus there like the engine's own); FINISHED has none (nothing is
        published)."""
        reason = _FINISH_REASONS.get(self.kind)
        if reason is None:
            raise ValueError(f"{self.kind} publishes no terminal delta")
        return reason


ABORTED = EndReason(EndKind.ABORTED)
DEADLINE = EndReason(EndKind.DEADLINE)
LENGTH = EndReason(EndKind.LENGTH)
FINISHED = EndReason(EndKind.FINISHED)
LOST = EndReason(EndKind.LOST)
FENCED = EndReason(EndKind.FENCED)
STOPPED = EndReason(EndKind.STOPPED)
HANDED_OVER = EndReason(EndKind.HANDED_OVER)


@dataclass(slots=True, eq=False)
class WorkItem:
    """One request this worker holds, from the poll until its offset may be committed."""

    request: GenerateRequest
    tp: TopicPartition
    offset: int
    deadline: float | None  # time.monotonic() seconds
    received_ms: int
    state: ItemState = ItemState.BUFFERED
    end: EndReason | None = None  # set once the worker decided to end it (see `stop`)
    attempt: int = 0
    resumed_token_ids: list[int] = field(default_factory=list)
    token_offset: int = 0  # absolute position of the next token
    text_offset: int = 0  # absolute position of the next character
    seq_no: int = 0
    num_generated: int = 0  # tokens this attempt generated
    admitted_ms: int | None = None  # taken from the fair queue (`start`)
    scheduled_ms: int | None = None
    first_token_ms: int | None = None
    # the request record's trace context, copied onto its telemetry record's headers
    trace_headers: list[tuple[str, bytes]] = field(default_factory=list)
    in_engine: bool = False  # admitted: counts against the engine's capacity
    num_engine_deaths: int = 0  # attempts the engine died under (a restart resumes them)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def tenant_id(self) -> str:
        return self.request.tenant_id

    @property
    def lane(self) -> str:
        return self.request.lane.value

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def cost(self) -> int:
        return self.prompt_tokens + self.request.sampling.max_tokens

    @property
    def silent(self) -> bool:
        """Lost, fenced, stopped or handed over: never deltas or progress."""
        return self.end is not None and self.end.silent

    @property
    def handed_over(self) -> bool:
        """Its next owner resumes it: no usage from here (that owner bills this attempt
        from the recorded progress), and its offset is never released."""
        return self.end is not None and self.end.kind is EndKind.HANDED_OVER

    # -- transitions ----------------------------------------------------------------
    def start(self) -> None:
        """Admitted to the engine, or about to be answered without running: its
        attempt is begun next (`begin`)."""
        self._move(ItemState.STARTING, ItemState.BUFFERED, ItemState.ORPHANED)
        self.admitted_ms = now_ms()

    def begin(self, start: AttemptStart) -> None:
        """Its attempt began: it continues from what earlier ones published (also this
        worker's own, when its engine died under the request)."""
        self._check(ItemState.STARTING)
        self.attempt = start.attempt
        self.resumed_token_ids = list(start.token_ids)
        self.token_offset = len(start.token_ids)
        self.text_offset = start.text_len
        self.seq_no = 0
        self.num_generated = 0

    def requeue(self) -> None:
        """Back to the buffer: the progress store was down, or the engine is back."""
        self._move(ItemState.BUFFERED, ItemState.STARTING, ItemState.ORPHANED)

    def run(self) -> None:
        """Submitted to the engine."""
        self._move(ItemState.RUNNING, ItemState.STARTING)
        self.scheduled_ms = now_ms()

    def orphan(self) -> None:
        """The engine died under it (or was down at its submit); a restart resumes it."""
        self._move(ItemState.ORPHANED, ItemState.RUNNING, ItemState.STARTING)

    def finishing(self) -> None:
        """Its terminal delta is built: from the engine, or answered without running."""
        self._move(ItemState.FINISHING, ItemState.RUNNING, ItemState.STARTING, ItemState.ORPHANED)

    def done(self) -> None:
        """Its offset is released: its publishes are confirmed, or there is nothing to
        publish (lost before it ran, or an earlier attempt finished it)."""
        self._move(
            ItemState.DONE,
            ItemState.FINISHING,
            ItemState.STARTING,
            ItemState.BUFFERED,
            ItemState.ORPHANED,
        )

    def stop(self, reason: EndReason) -> None:
        """Record why it ends (it stops at its next transition, or the engine's abort
        ends it). The first reason holds, except that a silent one (another member
        owns the request now) overrides one the client would have heard."""
        if self.end is None or (reason.silent and not self.end.silent):
            self.end = reason

    def _move(self, to: ItemState, *sources: ItemState) -> None:
        self._check(*sources, to=to)
        self.state = to

    def _check(self, *sources: ItemState, to: ItemState | None = None) -> None:
        if self.state not in sources:
            target = f" to {to.value}" if to is not None else ""
            raise IllegalTransition(
                f"request_id={self.request_id}: {self.state.value}{target} "
                f"(allowed from {', '.join(s.value for s in sources)})"
            )
