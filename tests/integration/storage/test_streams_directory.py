"""One contract suite for every StreamDirectory: in-process and real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from sluice.storage.streams import (
    MemoryStreamDirectory,
    RedisStreamDirectory,
    StreamDirectory,
    StreamRecord,
)

RECORD = StreamRecord("abc", "t1", "digest", reply_to="gw-a", owner="gw-a", deadline_ms=None)


@pytest.fixture(params=["memory", "redis"])
def directory(request: pytest.FixtureRequest) -> Iterator[StreamDirectory]:
    if request.param == "memory":
        yield MemoryStreamDirectory()
        return
    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("redis_prefix")
    store = RedisStreamDirectory(url, prefix=prefix, ttl_s=60)
    yield store
    store.close()


def test_a_record_reads_back_as_written(directory: StreamDirectory) -> None:
    assert directory.get("abc") is None
    directory.put(replace(RECORD, deadline_ms=123))
    assert directory.get("abc") == replace(RECORD, deadline_ms=123)


def test_a_claim_moves_the_owner_only_from_the_one_read(directory: StreamDirectory) -> None:
    directory.put(RECORD)
    assert directory.claim(RECORD, "gw-b")
    assert directory.get("abc") == replace(RECORD, owner="gw-b")
    assert not directory.claim(RECORD, "gw-c")  # gw-b took it since RECORD was read
    assert not directory.claim(replace(RECORD, call_id="gone"), "gw-c")


def test_only_the_owner_drops_a_record(directory: StreamDirectory) -> None:
    directory.put(RECORD)
    assert directory.claim(RECORD, "gw-b")
    directory.drop("abc", "gw-a")  # the gateway that parked it, at its window's end
    assert directory.get("abc") is not None
    directory.drop("abc", "gw-b")
    assert directory.get("abc") is None
