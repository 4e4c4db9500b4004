"""Key → partition, the same function for every transport.

Kafka's Java client and kafka-python hash keys with murmur2 (positive, modulo the
partition count); using it here keeps a tenant on the same partition whichever bus runs.
Key-less messages go round robin.
"""

from __future__ import annotations

import itertools

_round_robin = itertools.count()


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (32-bit, seed 0x9747B28C), as its Java client computes it."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = seed ^ length
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (
            (data[i4 + 0] & 0xFF)
            + ((data[i4 + 1] & 0xFF) << 8)
            + ((data[i4 + 2] & 0xFF) << 16)
            + ((data[i4 + 3] & 0xFF) << 24)
        )
        k = (k * m) & 0xFFFFFFFF
        k ^= (k % 0x100000000) >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    if extra >= 3:
        h ^= (data[(length & ~3) + 2] & 0xFF) << 16
    if extra >= 2:
        h ^= (data[(length & ~3) + 1] & 0xFF) << 8
    if extra >= 1:
        h ^= data[length & ~3] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= (h % 0x100000000) >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= (h % 0x100000000) >> 15
    return h


def partition_for(key: bytes | None, num_partitions: int) -> int:
    if num_partitions <= 1:
        return 0
    if key is None:
        return next(_round_robin) % num_partitions
    return (murmur2(key) & 0x7FFFFFFF) % num_partitions
