"""Chained block hashes for prefix caching: the key a full KV block is cached under.

Used by the scheduler when a request arrives (prompt blocks) and as output tokens fill
more blocks; the block pool indexes cached blocks by these hashes. No torch.

hash(block i) = H(hash(block i-1), tokens of block i), and block 0's parent is a random
per-process root (`NONE_HASH`-style) mixed with the tenant's cache salt and the request's
LoRA adapter, so equal prefixes of two tenants, or of two adapters (or an adapter and the
base model), never share blocks, and hashes cannot be probed from outside the process.
H is keyed BLAKE2b with a 128-bit digest: cheap (about a microsecond per block) and
collision-resistant, so a hit is trusted without comparing token ids.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence

from sluice.engine.core.request import Request
from sluice.engine.lora import LoRARequest

_DIGEST_SIZE = 16


class BlockHasher:
    """Computes and extends `Request.block_hashes` for one engine.

    seed: None for a random key (production); an int makes hashes reproducible (tests).
    """

    __slots__ = ("_key", "_root", "block_size")

    def __init__(self, block_size: int, seed: int | None = None) -> None:
        self.block_size = block_size
        if seed is None:
            self._key = os.urandom(32)
        else:
            self._key = hashlib.blake2b(seed.to_bytes(16, "little", signed=True)).digest()[:32]
        self._root = self._digest(b"", b"sluice-prefix-root")

    def _digest(self, parent: bytes, payload: bytes) -> int:
        h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE, key=self._key)
        h.update(payload)
        return int.from_bytes(h.digest(), "little")

    def first_parent(self, cache_salt: str | None, lora: LoRARequest | None = None) -> int:
        """The parent hash of block 0: the root, salted per tenant when a salt is given,
        then per LoRA adapter (its name and path: new weights under a name are another
        adapter) when the request has one."""
        parent = self._root
        if cache_salt:
            parent = self._digest(parent.to_bytes(_DIGEST_SIZE, "little"), cache_salt.encode())
        if lora is not None:
            # a prefix no salt can take: a tenant named like an adapter stays apart
            payload = b"\0lora\0" + lora.name.encode() + b"\0" + lora.path.encode()
            parent = self._digest(parent.to_bytes(_DIGEST_SIZE, "little"), payload)
        return parent

    def hash_block(self, parent_hash: int, token_ids: Sequence[int]) -> int:
        payload = array("q", token_ids).tobytes()
        return self._digest(parent_hash.to_bytes(_DIGEST_SIZE, "little"), payload)

    def extend(self, request: Request) -> None:
        """Append hashes for every full block of the request's known tokens not hashed yet.

        O(new full blocks): called after each appended token it does nothing until a
        block fills up.
        """
        block_size = self.block_size
        hashes = request.block_hashes
        num_full = request.num_tokens // block_size
        start = len(hashes)
        if start >= num_full:
            return
        parent = (
            hashes[-1] if hashes else self.first_parent(request.cache_salt, request.lora_request)
        )
        for i in range(start, num_full):
            parent = self.hash_block(
                parent, request.token_ids_slice(i * block_size, (i + 1) * block_size)
            )
            hashes.append(parent)
