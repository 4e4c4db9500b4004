"""The batches collector: the engine's deltas for batch lines → finished lines in the store.

Batch lines answer to the reply target `batches` (`sluice.tokens.batches.v1`), read by
one consumer group, so what the engine sent outlives any batches process: a partition's
offset is committed only below the first record of a line not yet stored, and a
restarted collector reads those lines' deltas again (docs/architecture.md §14).

Per line the collector keeps one `Track` per sub-request and a `Generation`, the same
bookkeeping the gateway keeps for a client: a lower attempt's deltas are fenced,
redelivered ones dropped, and a resumed attempt's overlap cut by absolute offsets. A
line is stored once (`BatchStore.finish_lines` ignores a line already done), so a
redelivered answer or a resumed attempt changes nothing.

What a line consumed is the usage on its requests' terminal deltas, which equals their
ledger rows: a line never run (cancelled or expired before the engine ran it) costs 0
and ends as `"response": null`; a line stopped part-way goes to the error file with that
usage; `batch.usage` adds up the same numbers. With a `BatchBudget` the collector
settles each finished request's quota from its terminal delta, as the gateway does for
its own requests, before the line leaves the batch's in-flight estimate.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sluice.api.errors import APIError, RequestCancelled
from sluice.api.generation import Generation, Track, accept
from sluice.api.served import ModelCatalog, ServedModel
from sluice.billing.batch_budget import BatchBudget
from sluice.bus.base import Consumer, EventBus, TopicPartition, TopicSpec
from sluice.bus.codec import decode_as
from sluice.bus.errors import BusError
from sluice.bus.messages import FinishReason, TokenDelta, TokenDeltaBatch, Usage
from sluice.bus.topics import reply_topic
from sluice.consumers.batches.lines import (
    BATCH_REPLY_TARGET,
    LineStopped,
    answer_body,
    line_call_id,
    line_request_id,
    output_line,
    parse_request_id,
    refused_line,
    run_error,
    stopped_line,
    unrun_line,
    usage_object,
)
from sluice.consumers.batches.runner import (
    CANCELLED_MESSAGE,
    EXPIRED_MESSAGE,
    STOPPED_CANCELLED_MESSAGE,
    STOPPED_EXPIRED_MESSAGE,
)
from sluice.storage.batches import BatchInfo, BatchStore, LineInfo, LineOutcome
from sluice.storage.errors import StoreError, StoreUnavailable
from sluice.tracing.metrics import ACTIVE_BATCH_STATUSES, count_batch_lines, set_batch_counts

logger = logging.getLogger(__name__)

GROUP = "batches"
LineKey = tuple[str, int]  # (batch_id, line)


class _NoCancel:
    """A line's `Generation` never cancels on its own: cancels come from the batch."""

    def cancel(self, generation: Generation, reason: str = "") -> None:
        return None


@dataclass(slots=True)
class _Line:
    info: LineInfo
    tracks: list[Track]
    generation: Generation
    first_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    # per sub-request: its terminal delta (attempt, usage): what the request consumed
    ends: dict[int, tuple[int, Usage | None]] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(t.done for t in self.tracks)


def _ensure_topic(bus: EventBus) -> None:
    """The engine keys a reply target's deltas by target, so one partition serves; a
    topic that already exists with more is read as it is."""
    try:
        bus.create_topics([TopicSpec(reply_topic(BATCH_REPLY_TARGET), 1)])
    except BusError as exc:
        logger.info("batch reply topic left as it is: %s", exc)


class BatchCollector:
    def __init__(
        self,
        bus: EventBus,
        store: BatchStore,
        models: Sequence[ServedModel] | ModelCatalog,
        on_batch_done: Callable[[str], None],
        *,
        budget: BatchBudget | None = None,
        poll_timeout_s: float = 0.2,
        flush_interval_s: float = 0.2,
    ) -> None:
        self.bus = bus
        self.store = store
        self.budget = budget
        # the runner's catalog (its adapters as of its last refresh), or the models alone
        self.models = models if isinstance(models, ModelCatalog) else ModelCatalog(models)
        self.on_batch_done = on_batch_done
        self.poll_timeout_s = poll_timeout_s
        self.flush_interval_s = flush_interval_s
        self.lines_stored = 0
        self._stopping = threading.Event()
        self._lines: dict[LineKey, _Line] = {}
        self._finished: list[tuple[_Line, LineOutcome]] = []
        self._done: OrderedDict[LineKey, None] = OrderedDict()  # stored lines, recent first out
        self._positions: dict[TopicPartition, int] = {}
        self._batches: dict[str, BatchInfo] = {}
        self._counted_at = 0.0  # when `sluice_batches` was last refreshed

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        consumer: Consumer | None = None
        flushed_at = time.monotonic()
        committed: dict[TopicPartition, int] = {}
        while not self._stopping.is_set():
            try:
                if consumer is None:
                    _ensure_topic(self.bus)
                    consumer = self.bus.consumer(
                        GROUP,
                        [reply_topic(BATCH_REPLY_TARGET)],
                        offset_reset="earliest",
                        on_revoke=self._on_revoke,
                    )
                records = consumer.poll(self.poll_timeout_s)
                for record in records:
                    self._positions[record.tp] = record.offset + 1
                    try:
                        batch = decode_as(TokenDeltaBatch, record.value)
                    except BusError as exc:
                        logger.warning(
                            "undecodable batch reply at offset %s: %s", record.offset, exc
                        )
                        continue
                    self._take(record.tp, record.offset, batch.deltas)
                if time.monotonic() - flushed_at >= self.flush_interval_s:
                    if self._finished:
                        self._flush()
                    positions = self._commit_positions()
                    if positions != committed:
                        consumer.commit(positions, wait=False)
                        committed = positions
                    flushed_at = time.monotonic()
                    self._count_batches(flushed_at)
            except (BusError, StoreUnavailable) as exc:
                logger.warning("batches collector: %s; retrying", exc)
                self._stopping.wait(1.0)
        if consumer is not None:
            try:
                if self._finished:
                    self._flush()
                consumer.commit(self._commit_positions(), wait=True)
                consumer.close()
            except (BusError, StoreUnavailable) as exc:
                logger.warning("batches collector close: %s", exc)

    def _on_revoke(self, partitions: set[TopicPartition]) -> None:
        # another member reads these from their committed offsets: forget them here
        for key, line in list(self._lines.items()):
            if set(line.first_offsets) & partitions:
                del self._lines[key]
        for tp in partitions:
            self._positions.pop(tp, None)

    # -- deltas --------------------------------------------------------------------
    def _take(self, tp: TopicPartition, offset: int, deltas: Sequence[TokenDelta]) -> None:
        wanted: dict[str, set[int]] = {}
        parsed = []
        for delta in deltas:
            ids = parse_request_id(delta.request_id)
            if ids is None or (ids[0], ids[1]) in self._done:
                continue
            parsed.append((ids, delta))
            if (ids[0], ids[1]) not in self._lines:
                wanted.setdefault(ids[0], set()).add(ids[1])
        for batch_id, lines in wanted.items():
            self._load(batch_id, lines)
        for (batch_id, line_no, index), delta in parsed:
            line = self._lines.get((batch_id, line_no))
            if line is None or index >= len(line.tracks):
                continue
            line.first_offsets.setdefault(tp, offset)
            track = line.tracks[index]
            if track.done or not accept(track, delta):
                continue
            if delta.finish_reason is not None:
                line.ends[index] = (delta.attempt, delta.usage)
            line.generation.take(track, delta)
            if line.done:
                del self._lines[(batch_id, line_no)]
                # its later deltas (redelivered, a fenced attempt's) are dropped from now
                # on: reloaded before the flush, they made a line that never finished and
                # held the partition's commits back
                self._mark_done((batch_id, line_no))
                self._finished.append((line, self._outcome(line)))

    def _load(self, batch_id: str, lines: set[int]) -> None:
        infos = self.store.get_lines(batch_id, lines)
        for line_no in lines:
            info = infos.get(line_no)
            if info is None or info.state == "done":
                self._mark_done((batch_id, line_no))  # a late or foreign delta: nothing to do
                continue
            tracks = [
                Track(index=i, request_id=line_request_id(batch_id, line_no, i))
                for i in range(info.requests)
            ]
            generation = Generation(tracks, tenant_id="", wait_until=None, service=_NoCancel())
            self._lines[(batch_id, line_no)] = _Line(info, tracks, generation)

    def _outcome(self, line: _Line) -> LineOutcome:
        info = line.info
        results = line.generation.results()
        used = self._used(line)
        counts = {
            "prompt_tokens": used.prompt_tokens,
            "cached_tokens": used.cached_tokens,
            "completion_tokens": used.completion_tokens,
        }
        request_id = line.tracks[0].request_id
        batch = self._batch(info.batch_id)
        endpoint = batch.endpoint if batch is not None else "/v1/chat/completions"
        ran = used.prompt_tokens + used.completion_tokens > 0
        finishes = {r.finish_reason for r in results}
        error: APIError | None = run_error(results)
        if "abort" in finishes or "deadline" in finishes:
            error = self._stopped_by_batch(info.batch_id, finishes) or RequestCancelled()
            if isinstance(error, LineStopped) and not ran:
                message = EXPIRED_MESSAGE if error.code == "batch_expired" else CANCELLED_MESSAGE
                result = unrun_line(info.custom_id, str(error.code), message)
                return LineOutcome(info.line, False, result)
        if error is not None:
            usage = usage_object(endpoint, **counts) if ran else None
            if isinstance(error, LineStopped) and usage is not None:
                result = stopped_line(info.custom_id, request_id, error, usage)
            else:
                result = refused_line(info.custom_id, request_id, error, usage)
            return LineOutcome(info.line, False, result, **counts)
        body = json.loads(info.body)
        try:
            model = self._served(body["model"])
        except APIError as exc:  # its adapter was unloaded while the line ran
            return LineOutcome(info.line, False, refused_line(info.custom_id, request_id, exc))
        answer = answer_body(
            endpoint,
            body,
            model,
            line_call_id(info.batch_id, info.line),
            results,
            used.prompt_tokens,
            used.cached_tokens,
            line.generation.created,
            used.completion_tokens,
        )
        return LineOutcome(
            info.line, True, output_line(info.custom_id, request_id, 200, answer), **counts
        )

    def _served(self, name: str) -> ServedModel:
        """The line's model; an adapter loaded since the catalog's last refresh (a restarted
        collector's) is looked up again once. Access was checked when the line was built."""
        try:
            return self.models.get(name)
        except APIError:
            with contextlib.suppress(StoreError):  # then the line is answered 404
                self.models.refresh()
            return self.models.get(name)

    def _stopped_by_batch(
        self, batch_id: str, finishes: set[FinishReason | None]
    ) -> LineStopped | None:
        """The batch's expiry or cancel, if that is what aborted the line."""
        batch = self._batch(batch_id, fresh=True)
        if "deadline" in finishes or (batch is not None and batch.expired_at is not None):
            return LineStopped("batch_expired", STOPPED_EXPIRED_MESSAGE)
        if batch is not None and batch.status == "cancelling":
            return LineStopped("batch_cancelled", STOPPED_CANCELLED_MESSAGE)
        return None

    @staticmethod
    def _used(line: _Line) -> Usage:
        """What the line's requests consumed: the sum of their terminal deltas' usage (a
        terminal delta without usage counts what it delivered, and the prompt once)."""
        prompt = cached = completion = 0
        for track in line.tracks:
            _, usage = line.ends.get(track.index, (0, None))
            if usage is None:
                billed = track.index == 0 and track.num_tokens > 0
                usage = Usage(
                    prompt_tokens=line.info.prompt_tokens if billed else 0,
                    cached_tokens=track.cached_tokens,
                    completion_tokens=track.num_tokens,
                )
            prompt += usage.prompt_tokens
            cached += usage.cached_tokens
            completion += usage.completion_tokens
        return Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)

    def _batch(self, batch_id: str, *, fresh: bool = False) -> BatchInfo | None:
        """The batch, read at most once per flush; `fresh` reads its status again (a
        cancel or an expiry may have moved it) unless it is already past running."""
        batch = self._batches.get(batch_id)
        if batch is None or (fresh and batch.status in ("in_progress", "validating")):
            batch = self.store.get_batch(batch_id)
            if batch is not None:
                self._batches[batch_id] = batch
        return batch

    # -- storing -------------------------------------------------------------------
    def _flush(self) -> None:
        by_batch: dict[str, list[LineOutcome]] = {}
        for line, outcome in self._finished:
            by_batch.setdefault(line.info.batch_id, []).append(outcome)
        if self.budget is not None:
            self._settle([line for line, _ in self._finished])
        for batch_id, outcomes in by_batch.items():
            stored = self.store.finish_lines(batch_id, outcomes)
            self.lines_stored += stored
            # lines stored before (a redelivery) are skipped; which of these they were is
            # not told, so the completed ones count first
            completed = min(stored, sum(o.ok for o in outcomes))
            count_batch_lines(completed, stored - completed)
        for line, _ in self._finished:
            self._mark_done((line.info.batch_id, line.info.line))
        self._finished.clear()
        for batch_id in by_batch:
            self._batches.pop(batch_id, None)
            # nothing of the batch in flight: it is done, or its lines still pending wait
            # for the budget its finished lines gave back (finalize dispatches them)
            if self.store.line_states(batch_id).get("queued", 0) == 0:
                try:
                    self.on_batch_done(batch_id)
                except Exception:  # the sweep finalizes it later
                    logger.exception("finalizing batch %s could not be started", batch_id)

    def _settle(self, lines: list[_Line]) -> None:
        """Each request's quota from its terminal delta (attempt 0's; a resumed request's
        attempts are settled by the quotas consumer from their usage records)."""
        assert self.budget is not None
        for line in lines:
            batch = self._batch(line.info.batch_id)
            if batch is None:
                continue
            model = json.loads(line.info.body).get("model", "")
            for track in line.tracks:
                attempt, usage = line.ends.get(track.index, (-1, None))
                if attempt == 0 and usage is not None:
                    self.budget.settle(batch.tenant_id, track.request_id, str(model), usage)

    def _count_batches(self, now: float, interval_s: float = 5.0) -> None:
        """Refresh `sluice_batches{status}` at most every `interval_s` (one query)."""
        if now - self._counted_at < interval_s:
            return
        self._counted_at = now
        try:
            batches = self.store.batches_with_status(ACTIVE_BATCH_STATUSES)
        except StoreUnavailable as exc:
            logger.debug("batch counts not refreshed: %s", exc)
            return
        counts: dict[str, int] = {}
        for batch in batches:
            counts[batch.status] = counts.get(batch.status, 0) + 1
        set_batch_counts(counts)

    def _mark_done(self, key: LineKey) -> None:
        self._done[key] = None
        if len(self._done) > 200_000:
            self._done.popitem(last=False)

    def _commit_positions(self) -> dict[TopicPartition, int]:
        """Each partition up to the first record of a line not yet stored."""
        positions = dict(self._positions)
        for line in self._lines.values():
            for tp, offset in line.first_offsets.items():
                if tp in positions:
                    positions[tp] = min(positions[tp], offset)
        for line, _ in self._finished:
            for tp, offset in line.first_offsets.items():
                if tp in positions:
                    positions[tp] = min(positions[tp], offset)
        return positions
