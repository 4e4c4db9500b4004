"""The pool of KV-cache blocks: ref counts, the LRU free list and the prefix-cache index.

Sits under `KVCacheManager`, which hands blocks to requests; the runner only ever sees
block ids. No torch.

- Block 0 is the null block (padding in block tables); it is never handed out or freed.
- The free list is in eviction order: blocks freed without a hash go to the head (reused
  first), blocks that hold a cached prefix go to the tail (kept longest). Taking a block
  from the head evicts its stale hash from the index.
- A cached block with ref_cnt 0 stays in the free list and in the index; a prefix hit
  `touch`es it back out of the free list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free (a caller bug: check first)."""


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set while the block is in the prefix-cache index


class BlockPool:
    """Owns every KV block of one engine.

    num_blocks includes the null block 0, so `num_blocks - 1` blocks are usable.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        # block_id -> block, in eviction order (head = next to hand out)
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[int, KVCacheBlock] = {}  # block_hash -> block

    # -- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def is_free(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._free

    def free_block_ids(self) -> list[int]:
        """Free list in eviction order (for tests and debugging)."""
        return list(self._free)

    # -- allocation ------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free list, evicting their cached hashes."""
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        free = self._free
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            _, block = free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling idle ones out of the free list."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks that reach 0 rejoin the free list.

        Pass a request's blocks in reverse order so its tail blocks are evicted first.
        """
        free = self._free
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block
                if block.block_hash is None:
                    free.move_to_end(block.block_id, last=False)
            elif block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than taken")

    # -- prefix cache ----------------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Index a full, computed block under its chained hash.

        If another block already holds this hash (two requests computed the same prefix
        in parallel), the first stays indexed and this one stays anonymous.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only allowed while no request holds a block."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True
