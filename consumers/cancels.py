"""Remembered cancels: requests and batches cancelled before their request arrived.

A `Cancel` is broadcast to every engine worker; the one that holds the request aborts it
at once. A request still queued on Kafka arrives later, possibly at another worker, so
every worker remembers cancelled ids for a while (bounded and with a TTL) and answers
such a request with a terminal 'abort' without running it. A batch's lines may wait on
the batch lane as long as its completion window, so a batch cancel is remembered that
long (`batch_ttl_s`); there are few batches, so this costs little.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from sluice.bus.messages import Cancel, GenerateRequest


class CancelRegistry:
    """Cancelled request ids and batch ids, each with its tenant, for `ttl_s` seconds."""

    def __init__(
        self,
        ttl_s: float = 600.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        batch_ttl_s: float = 2 * 86_400.0,
    ) -> None:
        self.ttl_s = ttl_s
        self.batch_ttl_s = batch_ttl_s
        self.max_entries = max_entries
        self._clock = clock
        # ("r", request_id) | ("b", batch_id) -> (tenant_id, expires_at)
        self._entries: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, cancel: Cancel) -> None:
        key = ("r", cancel.request_id) if cancel.request_id is not None else ("b", cancel.batch_id)
        assert key[1] is not None  # Cancel validates that exactly one id is set
        ttl_s = self.ttl_s if key[0] == "r" else self.batch_ttl_s
        self._entries[(key[0], key[1])] = (cancel.tenant_id, self._clock() + ttl_s)
        self._entries.move_to_end((key[0], key[1]))
        self.expire()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def expire(self) -> None:
        """Drop expired entries from the oldest on (a batch's long one may keep shorter
        ones behind it a while; `is_cancelled` checks each entry's own expiry)."""
        now = self._clock()
        while self._entries:
            key, (_, expires_at) = next(iter(self._entries.items()))
            if expires_at > now:
                break
            del self._entries[key]

    def is_cancelled(self, request: GenerateRequest) -> bool:
        """True when the request or its batch was cancelled by its own tenant."""
        keys = [("r", request.request_id)]
        if request.batch_id is not None:
            keys.append(("b", request.batch_id))
        now = self._clock()
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == request.tenant_id and entry[1] > now:
                return True
        return False


def cancel_matches(cancel: Cancel, request: GenerateRequest) -> bool:
    """Does this cancel target this request? Only the request's own tenant may cancel it."""
    if cancel.tenant_id != request.tenant_id:
        return False
    if cancel.request_id is not None:
        return cancel.request_id == request.request_id
    return request.batch_id is not None and cancel.batch_id == request.batch_id
