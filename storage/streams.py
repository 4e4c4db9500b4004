"""Where each resumable stream runs, shared by a deployment's gateways.

A gateway that opens a resumable stream (`api.resume`) writes a `StreamRecord`: the
call, its tenant, a digest of what was asked, the reply target its deltas go to, and
the gateway that serves it now. A client whose gateway died resumes on another one,
which finds the record here, claims it (the owner moves only from the one it read, so
two resumes cannot both take it) and reads the stream's deltas again from the reply
topic they went to. The owner that parked the stream drops the record once its window
passed; a killed one's record lapses with its TTL.

`MemoryStreamDirectory` serves one process (tests, `sluice serve`); `RedisStreamDirectory`
a fleet (one key per call, JSON, a TTL; claim and drop are Lua compare-and-set).

Errors: a Redis that does not answer raises `StoreUnavailable` (retryable).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import redis

from sluice.storage.errors import StoreUnavailable

# how long a record outlives its last write: a stream's run and its resume window fit
RECORD_TTL_S = 3600


@dataclass(frozen=True, slots=True)
class StreamRecord:
    """One resumable stream, as any gateway of the deployment may look it up."""

    call_id: str
    tenant_id: str
    request_digest: str  # what a resume must ask again (path and body), hashed
    reply_to: str  # the reply target its deltas are published to, for its whole run
    owner: str  # the gateway that serves it now
    deadline_ms: int | None = None
    created_s: int = 0  # when the first gateway created it (its chunks' `created`)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> StreamRecord:
        return cls(**json.loads(raw))


class StreamDirectory(Protocol):
    """The deployment's resumable streams, by call id."""

    def put(self, record: StreamRecord) -> None: ...

    def get(self, call_id: str) -> StreamRecord | None: ...

    def claim(self, record: StreamRecord, owner: str) -> bool:
        """Make `owner` serve the stream if `record.owner` still does; False when another
        gateway took it meanwhile or the record is gone."""
        ...

    def drop(self, call_id: str, owner: str) -> None:
        """Forget the stream if `owner` still serves it."""
        ...


class MemoryStreamDirectory:
    """One process's directory (no TTL: its streams end with it)."""

    def __init__(self) -> None:
        self._records: dict[str, StreamRecord] = {}
        self._lock = threading.Lock()  # gateways call it from worker threads

    def put(self, record: StreamRecord) -> None:
        with self._lock:
            self._records[record.call_id] = record

    def get(self, call_id: str) -> StreamRecord | None:
        with self._lock:
            return self._records.get(call_id)

    def claim(self, record: StreamRecord, owner: str) -> bool:
        with self._lock:
            current = self._records.get(record.call_id)
            if current is None or current.owner != record.owner:
                return False
            self._records[record.call_id] = replace(current, owner=owner)
            return True

    def drop(self, call_id: str, owner: str) -> None:
        with self._lock:
            current = self._records.get(call_id)
            if current is not None and current.owner == owner:
                del self._records[call_id]


# KEYS[1] the record; ARGV: the owner read, the new record's JSON, the TTL
_CLAIM = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
if cjson.decode(raw)['owner'] ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
return 1
"""
# KEYS[1] the record; ARGV[1] the owner that drops it
_DROP = """
local raw = redis.call('GET', KEYS[1])
if raw and cjson.decode(raw)['owner'] == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisStreamDirectory:
    """The fleet's directory: `<prefix>:<call id>` → the record's JSON, with a TTL."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "sluice:stream",
        ttl_s: int = RECORD_TTL_S,
        timeout_s: float = 2.0,
    ) -> None:
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._claim = self._redis.register_script(_CLAIM)
        self._drop = self._redis.register_script(_DROP)

    def _key(self, call_id: str) -> str:
        return f"{self._prefix}:{call_id}"

    def put(self, record: StreamRecord) -> None:
        with _unavailable_on_redis_error():
            self._redis.set(self._key(record.call_id), record.to_json(), ex=self._ttl_s)

    def get(self, call_id: str) -> StreamRecord | None:
        with _unavailable_on_redis_error():
            raw = self._redis.get(self._key(call_id))
        return None if raw is None else StreamRecord.from_json(raw)

    def claim(self, record: StreamRecord, owner: str) -> bool:
        claimed = replace(record, owner=owner)
        with _unavailable_on_redis_error():
            done = self._claim(
                keys=[self._key(record.call_id)],
                args=[record.owner, claimed.to_json(), self._ttl_s],
            )
        return bool(done)

    def drop(self, call_id: str, owner: str) -> None:
        with _unavailable_on_redis_error():
            self._drop(keys=[self._key(call_id)], args=[owner])

    def close(self) -> None:
        self._redis.close()


@contextlib.contextmanager
def _unavailable_on_redis_error() -> Iterator[None]:
    try:
        yield
    except redis.RedisError as exc:
        raise StoreUnavailable(f"stream directory unavailable: {exc}") from exc
