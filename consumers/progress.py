"""Per-request generation progress: what a failover resumes from, and attempt fencing.

Sits beside the engine worker (docs/architecture.md §5.5, §12). After each engine step's
`TokenDeltaBatch` publish is confirmed, the worker records per request the attempt, the
tokens it appended and the absolute text length published so far. When a worker dies
mid-stream, the member that receives the request after the rebalance calls
`begin_attempts`, which atomically bumps the attempt and returns what was already
delivered: it submits prompt + those tokens and continues the absolute offsets. A write
from a lower attempt than the stored one is rejected, so a zombie worker learns it was
fenced and aborts the request.

`MemoryProgressStore` serves embedded mode (one process); `RedisProgressStore` serves
distributed mode (atomic Lua scripts, one pipelined round trip per call, keys with a
TTL). This is the only module of `consumers` that imports redis.

Errors: a store that cannot be reached raises `ProgressUnavailable` (retryable: nothing
was begun or recorded); any other exception is a bug.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import redis

_A = TypeVar("_A")
_R = TypeVar("_R")


class ProgressUnavailable(Exception):
    """The progress store could not be reached; retryable: the call had no effect the
    caller relies on (a begin is retried, a record is left to the next step)."""

    retryable = True


@dataclass(frozen=True, slots=True)
class AttemptStart:
    """The outcome of `begin_attempts` for one request.

    token_ids / text_len: what earlier attempts published (confirmed by the bus), which
    the new attempt continues from; finished: an earlier attempt already published the
    terminal delta, so there is nothing left to do. superseded: (attempt, tokens) of the
    attempt this one replaces (or, when finished, the one that finished the request),
    when that one published tokens since it began: its worker died or lost the request,
    so its usage record may never come (a kill -9, also between recording the finish and
    publishing the usage); the caller publishes one from these counts, which the
    attempt's own record replaces should it come (one ledger row per attempt).
    """

    attempt: int
    token_ids: list[int] = field(default_factory=list)
    text_len: int = 0
    finished: bool = False
    superseded: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class StepProgress:
    """What one attempt of one request published in one engine step.

    token_offset is the absolute position of `token_ids[0]` (equal to the count recorded
    before this step); text_len is the absolute text length published after this step.
    """

    request_id: str
    attempt: int
    token_offset: int
    token_ids: list[int]
    text_len: int
    finished: bool = False


class ProgressStore(Protocol):
    """Attempts and published progress per request; all methods are thread-safe.

    in_process: calls touch memory only and return at once, so the worker makes them on
    its event loop (`call`) rather than hopping to its I/O thread and back.
    """

    in_process: bool

    def begin_attempts(self, requests: Sequence[tuple[str, int]]) -> list[AttemptStart]:
        """For each (request_id, min_attempt): the next attempt, atomically.

        The attempt is max(stored + 1, min_attempt), or min_attempt the first time; a
        finished request keeps its attempt and comes back with `finished=True`. Raises
        `ProgressUnavailable` when the store cannot be reached.
        """
        ...

    def record(self, steps: Sequence[StepProgress]) -> set[str]:
        """Append each step's progress; returns the request ids whose write was fenced
        (a higher attempt has begun), which the caller must abort. Raises
        `ProgressUnavailable` when the store cannot be reached."""
        ...

    def close(self) -> None: ...


async def call(store: ProgressStore, io: Executor, fn: Callable[[_A], _R], arg: _A) -> _R:
    """`fn(arg)`, a method of `store`: inline when the store is in-process, else on `io`.

    The hop to a thread and back costs far more than the in-memory call itself, on every
    request's way to the engine.
    """
    if store.in_process:
        return fn(arg)
    return await asyncio.get_running_loop().run_in_executor(io, fn, arg)


@dataclass(slots=True)
class _Progress:
    attempt: int
    token_ids: list[int] = field(default_factory=list)
    text_len: int = 0
    finished: bool = False
    start: int = 0  # tokens published before the current attempt began


class MemoryProgressStore:
    """Embedded mode: a bounded dict (oldest entries evicted past `max_requests`)."""

    in_process = True

    def __init__(self, max_requests: int = 100_000) -> None:
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Progress] = OrderedDict()

    def begin_attempts(self, requests: Sequence[tuple[str, int]]) -> list[AttemptStart]:
        out: list[AttemptStart] = []
        with self._lock:
            for request_id, min_attempt in requests:
                entry = self._entries.get(request_id)
                superseded = None
                if entry is None:
                    entry = self._entries[request_id] = _Progress(min_attempt)
                else:
                    published = len(entry.token_ids) - entry.start
                    if published > 0:
                        superseded = (entry.attempt, published)
                    if not entry.finished:
                        entry.attempt = max(entry.attempt + 1, min_attempt)
                        entry.start = len(entry.token_ids)
                self._entries.move_to_end(request_id)
                out.append(
                    AttemptStart(
                        entry.attempt,
                        list(entry.token_ids),
                        entry.text_len,
                        entry.finished,
                        superseded,
                    )
                )
            while len(self._entries) > self.max_requests:
                self._entries.popitem(last=False)
        return out

    def record(self, steps: Sequence[StepProgress]) -> set[str]:
        fenced: set[str] = set()
        with self._lock:
            for step in steps:
                entry = self._entries.get(step.request_id)
                if entry is None:
                    entry = self._entries[step.request_id] = _Progress(step.attempt)
                if step.attempt < entry.attempt or step.token_offset > len(entry.token_ids):
                    fenced.add(step.request_id)
                    continue
                entry.attempt = step.attempt
                del entry.token_ids[step.token_offset :]  # a replayed write is idempotent
                entry.token_ids.extend(step.token_ids)
                entry.text_len = max(entry.text_len, step.text_len)
                entry.finished = entry.finished or step.finished
        return fenced

    def close(self) -> None:
        """Nothing to release."""


# KEYS[1] = meta hash, KEYS[2] = token list. ARGV: min_attempt, ttl_s.
# Returns {attempt, text_len, finished, superseded attempt (-1: none), its tokens,
# tokens...}; 'start' in the hash is the token count when the current attempt began.
_BEGIN = """
local cur = redis.call('HGET', KEYS[1], 'attempt')
local finished = tonumber(redis.call('HGET', KEYS[1], 'finished') or '0')
local attempt = tonumber(ARGV[1])
local prev, published = -1, 0
if cur then
  attempt = tonumber(cur)
  local n = redis.call('LLEN', KEYS[2])
  published = n - tonumber(redis.call('HGET', KEYS[1], 'start') or '0')
  if published > 0 then prev = attempt end
  if finished == 0 then
    attempt = math.max(attempt + 1, tonumber(ARGV[1]))
    redis.call('HSET', KEYS[1], 'start', n)
  end
end
redis.call('HSET', KEYS[1], 'attempt', attempt)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
local text_len = tonumber(redis.call('HGET', KEYS[1], 'text_len') or '0')
local out = {attempt, text_len, finished, prev, published}
for _, t in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do out[#out + 1] = tonumber(t) end
return out
"""

# KEYS as above. ARGV: attempt, token_offset, text_len, finished, ttl_s, tokens...
# Returns 1 when recorded, 0 when fenced (lower attempt, or a gap in the tokens).
_RECORD = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '-1')
local attempt = tonumber(ARGV[1])
if attempt < cur then return 0 end
local n = redis.call('LLEN', KEYS[2])
local offset = tonumber(ARGV[2])
if offset > n then return 0 end
if offset < n then
  if offset == 0 then redis.call('DEL', KEYS[2])
  else redis.call('LTRIM', KEYS[2], 0, offset - 1) end
end
if #ARGV > 5 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 6)) end
local text_len = tonumber(redis.call('HGET', KEYS[1], 'text_len') or '0')
redis.call('HSET', KEYS[1], 'attempt', attempt, 'text_len', math.max(text_len, tonumber(ARGV[3])))
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'finished', 1) end
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
"""


class RedisProgressStore:
    """Distributed mode: one hash + one list per request, each call one pipelined round trip.

    Keys are `{prefix}{{request_id}}:meta` and `...:tokens` (a hash tag keeps both on one
    Redis Cluster slot, which a Lua script needs); every write refreshes their TTL.
    """

    in_process = False

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "sluice:progress:",
        ttl_s: int = 6 * 3600,
        client: Any = None,
    ) -> None:
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._redis: Any = client or redis.Redis.from_url(url, socket_timeout=5.0)
        self._begin = self._redis.register_script(_BEGIN)
        self._record = self._redis.register_script(_RECORD)

    def _keys(self, request_id: str) -> list[str]:
        base = f"{self.prefix}{{{request_id}}}"
        return [f"{base}:meta", f"{base}:tokens"]

    def ping(self) -> bool:
        return bool(self._redis.ping())

    def begin_attempts(self, requests: Sequence[tuple[str, int]]) -> list[AttemptStart]:
        if not requests:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for request_id, min_attempt in requests:
            self._begin(keys=self._keys(request_id), args=[min_attempt, self.ttl_s], client=pipe)
        with _unavailable_on_redis_error():
            replies = pipe.execute()
        out: list[AttemptStart] = []
        for reply in replies:
            attempt, text_len, finished, prev, published, *tokens = (int(v) for v in reply)
            superseded = (prev, published) if prev >= 0 else None
            out.append(AttemptStart(attempt, tokens, text_len, bool(finished), superseded))
        return out

    def record(self, steps: Sequence[StepProgress]) -> set[str]:
        if not steps:
            return set()
        pipe = self._redis.pipeline(transaction=False)
        for s in steps:
            args = [s.attempt, s.token_offset, s.text_len, int(s.finished), self.ttl_s]
            self._record(keys=self._keys(s.request_id), args=[*args, *s.token_ids], client=pipe)
        with _unavailable_on_redis_error():
            replies = pipe.execute()
        return {s.request_id for s, ok in zip(steps, replies, strict=True) if not int(ok)}

    def delete(self, request_id: str) -> None:
        self._redis.delete(*self._keys(request_id))

    def close(self) -> None:
        self._redis.close()


@contextlib.contextmanager
def _unavailable_on_redis_error() -> Iterator[None]:
    """Redis's connection, timeout and server errors → `ProgressUnavailable`."""
    try:
        yield
    except redis.RedisError as exc:
        raise ProgressUnavailable(f"progress store: {exc}") from exc
