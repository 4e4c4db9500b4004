"""Per-request KV block tables on top of the block pool: prefix hits, allocation, freeing.

Called by the scheduler: `get_computed_blocks` at admission, `allocate_slots` before a
request is scheduled, `cache_blocks` after its tokens were computed, `free` when it
finishes or is preempted. The block-id lists it keeps are what the runner reads. No torch.
"""

from __future__ import annotations

from sluice.engine.core.block_pool import BlockPool, KVCacheBlock
from sluice.engine.core.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already indexed

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's live block table (do not mutate; it grows in place)."""
        return self._block_ids[request_id]

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self._blocks.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks that prefixes the request, and its token count.

        Never covers the last known token (the hit is capped at num_tokens - 1): that
        token must be computed again to get logits for the next one. None for a request
        that wants prompt logprobs: every prompt position's logits are needed (as vLLM).
        """
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        pool = self.block_pool
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of the request; False if KV is full.

        `new_computed_blocks` are prefix hits from `get_computed_blocks` (admission only);
        their tokens count as computed. On False nothing changed.
        """
        request_id = request.request_id
        blocks = self._blocks.get(request_id)
        num_held = len(blocks) if blocks is not None else 0
        hits = new_computed_blocks or ()
        num_hit_tokens = len(hits) * self.block_size
        num_tokens_needed = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_blocks_needed = -(-num_tokens_needed // self.block_size) - num_held - len(hits)
        pool = self.block_pool
        # hits idle in the free list stop being free once touched
        num_idle_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_blocks_needed > pool.num_free_blocks - num_idle_hits:
            return False
        if blocks is None:
            blocks = self._blocks[request_id] = []
            block_ids = self._block_ids[request_id] = []
            self._num_cached_blocks[request_id] = 0
        else:
            block_ids = self._block_ids[request_id]
        if hits:
            pool.touch(hits)
            blocks.extend(hits)
            block_ids.extend(b.block_id for b in hits)
            self._num_cached_blocks[request_id] = len(blocks)
        if num_blocks_needed > 0:
            new_blocks = pool.get_new_blocks(num_blocks_needed)
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        return True

    def cache_blocks(self, request: Request) -> None:
        """Index the request's full blocks whose tokens are computed (num_computed_tokens)."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        blocks = self._blocks.get(request_id)
        if blocks is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks[request_id]
        if num_full <= start:
            return
        pool = self.block_pool
        hashes = request.block_hashes
        for i in range(start, num_full):
            pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its newest blocks are evicted first."""
        request_id = request.request_id
        blocks = self._blocks.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def num_requests(self) -> int:
        return len(self._blocks)
