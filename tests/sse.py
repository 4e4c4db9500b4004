"""Reading a raw SSE stream the way a resuming client must: each event's `id:` with its
`data:`, kept even when the connection breaks mid-stream."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import httpx

Events = list[tuple[str | None, str]]


def read_events(lines: Iterable[str], events: Events, stop_after: int | None = None) -> None:
    """Append the (id, data) of each event in `lines` to `events`, until `events` holds
    `stop_after` of them or the connection ends, cleanly or not (what arrived stays)."""
    event_id = None
    with contextlib.suppress(httpx.HTTPError):
        for line in lines:
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                events.append((event_id, line[6:]))
                event_id = None
                if stop_after is not None and len(events) >= stop_after:
                    return
