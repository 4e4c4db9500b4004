"""Chained block hashes: incremental extension, salting, seeding."""

from __future__ import annotations

from sluice.engine.core.hashing import BlockHasher
from sluice.engine.core.request import Request
from sluice.engine.sampling import SamplingParams


def _request(prompt: list[int], salt: str | None = None) -> Request:
    return Request("r", prompt, SamplingParams(), cache_salt=salt)


def test_extending_token_by_token_equals_hashing_at_once() -> None:
    hasher = BlockHasher(block_size=4, seed=1)
    whole = _request([*range(10), 7, 8, 9, 10, 11, 12])
    hasher.extend(whole)
    grown = _request(list(range(10)))
    hasher.extend(grown)
    assert len(grown.block_hashes) == 2
    for token_id in [7, 8, 9, 10, 11, 12]:
        grown.output_token_ids.append(token_id)
        hasher.extend(grown)
    assert grown.block_hashes == whole.block_hashes and len(whole.block_hashes) == 4


def test_hash_chains_on_the_parent_and_salt() -> None:
    hasher = BlockHasher(block_size=2, seed=1)
    a, b = _request([1, 2, 3, 4]), _request([9, 9, 3, 4])
    hasher.extend(a)
    hasher.extend(b)
    assert a.block_hashes[1] != b.block_hashes[1]  # same tokens, different prefix
    t1, t2 = _request([1, 2], "tenant-1"), _request([1, 2], "tenant-2")
    hasher.extend(t1)
    hasher.extend(t2)
    assert len({t1.block_hashes[0], t2.block_hashes[0], a.block_hashes[0]}) == 3


def test_seed_makes_hashes_reproducible_and_default_is_random() -> None:
    requests = [_request([1, 2]) for _ in range(4)]
    for request, hasher in zip(
        requests,
        [BlockHasher(2, seed=3), BlockHasher(2, seed=3), BlockHasher(2), BlockHasher(2)],
        strict=True,
    ):
        hasher.extend(request)
    assert requests[0].block_hashes == requests[1].block_hashes
    assert requests[2].block_hashes != requests[3].block_hashes
