"""`KafkaEventBus`: the `EventBus` contract on kafka-python, for distributed mode.

The only module in Sluice that imports kafka; client errors are translated into
`bus.errors` here. Consumer timings follow DESIGN.md §9: short sessions and heartbeats so
groups settle in seconds, and a small fetch wait because Tansu does not answer a waiting
fetch early.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import kafka
import kafka.errors as kerr
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.structs import OffsetAndMetadata
from kafka.structs import TopicPartition as KafkaTP

from bus.base import (
    Consumer,
    Delivered,
    Headers,
    OffsetReset,
    RebalanceCallback,
    Record,
    TopicPartition,
    TopicSpec,
)
from bus.errors import BusError, BusUnavailable, CommitFailed, DeliveryFailed, TopicError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KafkaConfig:
    """Connection and client tuning; built by the composition root from settings."""

    bootstrap: str
    client_id: str = "sluice"
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 500
    max_poll_interval_ms: int = 60000
    fetch_max_wait_ms: int = 5
    linger_ms: int = 0
    request_timeout_ms: int = 15000
    acks: int | str = "all"

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.bootstrap.split(",") if s.strip()]


def _translate(exc: Exception) -> BusError:
    if isinstance(exc, BusError):
        return exc
    if isinstance(exc, kerr.CommitFailedError):
        return CommitFailed(str(exc))
    unavailable = (kerr.KafkaTimeoutError, kerr.KafkaConnectionError)
    if isinstance(exc, unavailable):
        return BusUnavailable(str(exc) or type(exc).__name__)
    retryable = bool(getattr(exc, "retriable", False))
    return BusUnavailable(str(exc)) if retryable else BusError(f"{type(exc).__name__}: {exc}")


class KafkaEventBus:
    """A thread-safe producer shared by all publishers, and consumers made on demand."""

    def __init__(self, config: KafkaConfig) -> None:
        self.config = config
        try:
            self._producer = kafka.KafkaProducer(
                bootstrap_servers=config.servers,
                client_id=config.client_id,
                acks=config.acks,
                linger_ms=config.linger_ms,
                request_timeout_ms=config.request_timeout_ms,
                retries=5,
            )
        except Exception as exc:
            raise _translate(exc) from exc
        self._admin: KafkaAdminClient | None = None
        self._admin_lock = threading.Lock()

    # -- topics ---------------------------------------------------------------------
    def _admin_client(self) -> KafkaAdminClient:
        with self._admin_lock:
            if self._admin is None:
                self._admin = KafkaAdminClient(
                    bootstrap_servers=self.config.servers,
                    client_id=f"{self.config.client_id}-admin",
                    request_timeout_ms=self.config.request_timeout_ms,
                )
            return self._admin

    def create_topics(self, topics: Sequence[TopicSpec]) -> None:
        """Create missing topics; an existing one must have the partitions asked for."""
        admin = self._admin_client()
        try:
            existing = set(admin.list_topics())
            new = [
                NewTopic(name=t.name, num_partitions=t.num_partitions, replication_factor=1)
                for t in topics
                if t.name not in existing
            ]
            if new:
                with contextlib.suppress(kerr.TopicAlreadyExistsError):
                    admin.create_topics(new_topics=new, validate_only=False)
        except Exception as exc:
            raise _translate(exc) from exc
        for spec in topics:
            found = self.num_partitions(spec.name)
            if found != spec.num_partitions:
                raise TopicError(
                    f"topic {spec.name} has {found} partitions, configured {spec.num_partitions}"
                )

    def num_partitions(self, topic: str) -> int:
        try:
            parts = self._producer.partitions_for(topic)
        except Exception as exc:
            raise _translate(exc) from exc
        if not parts:
            raise TopicError(f"topic {topic} does not exist")
        return len(parts)

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
        try:
            sent = self._producer.send(
                topic, value=value, key=key, headers=headers or [], partition=partition
            )
        except Exception as exc:
            future.set_exception(_translate(exc))
            return future

        def ok(meta: Any) -> None:
            future.set_result(Delivered(meta.topic, meta.partition, meta.offset))

        def failed(exc: Exception) -> None:
            future.set_exception(DeliveryFailed(f"{topic}: {exc}"))

        sent.add_callback(ok)
        sent.add_errback(failed)
        return future

    def flush(self, timeout_s: float = 10.0) -> None:
        try:
            self._producer.flush(timeout=timeout_s)
        except Exception as exc:
            raise _translate(exc) from exc

    # -- consuming ------------------------------------------------------------------
    def consumer(
        self,
        group_id: str,
        topics: Sequence[str],
        *,
        offset_reset: OffsetReset = "earliest",
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> KafkaConsumer:
        return KafkaConsumer(self.config, group_id, topics, offset_reset, on_assign, on_revoke)

    def close(self) -> None:
        try:
            self._producer.flush(timeout=5)
            self._producer.close(timeout=5)
        finally:
            if self._admin is not None:
                self._admin.close()


class _Listener(kafka.ConsumerRebalanceListener):  # type: ignore[misc]
    """Queues rebalance events; `KafkaConsumer.poll` runs the callbacks on its own thread.

    kafka-python 3 calls listeners on its IO thread, where a blocking call (a commit in
    on_revoke, say) raises; the bus contract promises callbacks on the polling thread.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, set[TopicPartition]]] = []
        self._lock = threading.Lock()

    def _add(self, kind: str, partitions: Any) -> None:
        with self._lock:
            self.events.append(
                (kind, {TopicPartition(tp.topic, tp.partition) for tp in partitions})
            )

    def take(self) -> list[tuple[str, set[TopicPartition]]]:
        with self._lock:
            events, self.events = self.events, []
        return events

    def on_partitions_revoked(self, revoked: Any) -> None:
        self._add("revoke", revoked)

    def on_partitions_assigned(self, assigned: Any) -> None:
        self._add("assign", assigned)


# kafka-python cannot finish a group join inside a zero-timeout poll (the sync step is
# abandoned and the join starts over), so an unassigned member polls at least this long.
_JOIN_POLL_MS = 100


class KafkaConsumer(Consumer):
    """A kafka-python group member with manual commits."""

    def __init__(
        self,
        config: KafkaConfig,
        group_id: str,
        topics: Sequence[str],
        offset_reset: OffsetReset,
        on_assign: RebalanceCallback | None,
        on_revoke: RebalanceCallback | None,
    ) -> None:
        try:
            self._consumer = kafka.KafkaConsumer(
                bootstrap_servers=config.servers,
                client_id=config.client_id,
                group_id=group_id,
                enable_auto_commit=False,
                auto_offset_reset=offset_reset,
                session_timeout_ms=config.session_timeout_ms,
                heartbeat_interval_ms=config.heartbeat_interval_ms,
                max_poll_interval_ms=config.max_poll_interval_ms,
                fetch_max_wait_ms=config.fetch_max_wait_ms,
                request_timeout_ms=max(config.request_timeout_ms, config.session_timeout_ms + 5000),
            )
            self._listener = _Listener()
            self._on_assign = on_assign
            self._on_revoke = on_revoke
            self._consumer.subscribe(list(topics), listener=self._listener)
        except Exception as exc:
            raise _translate(exc) from exc

    def poll(self, timeout_s: float, max_records: int = 500) -> list[Record]:
        self._unpark_resumed()
        timeout_ms = int(timeout_s * 1000)
        if timeout_ms < _JOIN_POLL_MS and not self._consumer.assignment():
            timeout_ms = _JOIN_POLL_MS
        try:
            batches = self._consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        except Exception as exc:
            raise _translate(exc) from exc
        self._dispatch_rebalance()
        out: list[Record] = []
        for tp in sorted(batches, key=lambda t: (t.topic, t.partition)):
            for m in batches[tp]:
                out.append(
                    Record(
                        topic=m.topic,
                        partition=m.partition,
                        offset=m.offset,
                        key=m.key,
                        value=m.value,
                        headers=[(k, v) for k, v in (m.headers or [])],
                        timestamp_ms=m.timestamp,
                    )
                )
        return out

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        if not offsets:
            return
        payload = {
            KafkaTP(tp.topic, tp.partition): OffsetAndMetadata(off, "", -1)
            for tp, off in offsets.items()
        }
        try:
            self._consumer.commit(offsets=payload)
        except Exception as exc:
            raise _translate(exc) from exc

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def pause(self, partitions: Sequence[TopicPartition]) -> None:
        self._consumer.pause(*[KafkaTP(tp.topic, tp.partition) for tp in partitions])

    def resume(self, partitions: Sequence[TopicPartition]) -> None:
        self._consumer.resume(*[KafkaTP(tp.topic, tp.partition) for tp in partitions])

    def paused(self) -> set[TopicPartition]:
        return {TopicPartition(tp.topic, tp.partition) for tp in self._consumer.paused()}

    def _unpark_resumed(self) -> None:
        """Work around a kafka-python 3.0.12 stall after pause/resume.

        Its fetcher parks a paused partition's fetched records and excludes the partition
        from fetching while they are parked; after resume it restores them only when its
        in-line slot is None, but an exhausted batch stays there (falsy, not None). With
        no new fetch data to replace it the resumed partition never delivers again: the
        engine worker lost the tail of its lanes at the end of loaded `bench serving` runs
        (13-32 of 160 requests). Clearing the exhausted slot lets the next poll restore
        them; `test_a_partition_paused_with_records_in_line_delivers_them_after_resume`
        reproduces the stall without this.
        """
        fetcher = getattr(self._consumer, "_fetcher", None)
        current = getattr(fetcher, "_next_partition_records", None)
        if (
            current is not None
            and not current
            and getattr(fetcher, "_paused_partition_records", None)
        ):
            fetcher._next_partition_records = None  # type: ignore[union-attr]

    def _dispatch_rebalance(self) -> None:
        for kind, partitions in self._listener.take():
            callback = self._on_assign if kind == "assign" else self._on_revoke
            if callback is not None and partitions:
                callback(partitions)

    def close(self) -> None:
        """Leave the group; on_revoke runs first, here, so it may still commit."""
        if self._on_revoke is not None:
            held = self.assignment()
            if held:
                try:
                    self._on_revoke(held)
                except Exception:
                    logger.warning("on_revoke failed while closing", exc_info=True)
            self._on_revoke = None
        self._on_assign = None
        try:
            self._consumer.close(autocommit=False)
        except Exception:  # closing is best effort; the group times the member out
            logger.warning("kafka consumer close failed", exc_info=True)


def check_kafka(bootstrap: str, timeout_s: float = 3.0) -> str:
    """Ask the cluster for its brokers; raises `BusUnavailable` when it does not answer."""
    config = KafkaConfig(bootstrap=bootstrap)
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=config.servers,
            client_id="sluice-doctor",
            request_timeout_ms=int(timeout_s * 1000),
            bootstrap_timeout_ms=int(timeout_s * 1000),
        )
    except Exception as exc:
        raise _translate(exc) from exc
    try:
        cluster = admin.describe_cluster()
        brokers = cluster.get("brokers", [])
        return f"{len(brokers)} broker(s), cluster {cluster.get('cluster_id')}"
    except Exception as exc:
        raise _translate(exc) from exc
    finally:
        admin.close()
