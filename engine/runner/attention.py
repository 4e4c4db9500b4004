"""Paged attention in plain PyTorch: KV slot writes plus one batched SDPA per request group.

Called by every decoder layer in `engine.models.llama`; its metadata is built once per step by
`engine.runner.inputs`. Layout (gather-then-SDPA, as Transformers' continuous batching does):
each layer has one KV cache tensor
`[num_blocks, block_size, 2, num_kv_heads, head_dim]` (K then V per slot), so this step's K|V
rows (adjacent in the fused qkv output) go in with one `index_copy_` through the flat slot
view, and each group gathers K and V of its padded block table with one `index_select` and
runs one SDPA call. (One op each instead of two: every op costs ~3-10 µs per layer on CPU.)

Rows come in two groups: decode rows (one query token per request, first in the flat batch)
and prefill rows (chunks, padded to the longest chunk). GQA is done by folding the query
heads that share a KV head into extra query rows (`[B, Hkv, G*Q, D]`) rather than
`enable_gqa=True`, which is several times slower in bf16 on CPU. Masks are additive,
lower-right causal (never `is_causal=True`, which is top-left aligned: §4.5), and apply the
sliding window when the layer has one. A group of one decoding request (`num_keys` set) needs
no mask: its keys are sliced to exactly the positions it may see; when its blocks are
consecutive (`first_block`) they are read in place, without the gather.

A bf16 step on an AVX512-BF16 CPU (`AttentionMetadata.bf16_ops`) skips the gather, the
padding and the masks: every group's rows attend on `CpuOps.attn_paged`, one query row at
a time over its request's blocks in place, to its position + 1 keys (`row_keys`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sluice.engine.kernels import CpuOps, DecodePlan
    from sluice.engine.models.lora import LoRAStep


@dataclass(slots=True)
class AttentionGroup:
    """One SDPA call's worth of requests: P requests, queries padded to q_len, keys to kv_len."""

    row_start: int  # first flat token row of the group
    num_rows: int  # real (unpadded) token rows
    num_requests: int
    q_len: int  # padded query length per request
    kv_len: int  # padded key length per request (a multiple of block_size)
    block_index: torch.Tensor  # [P * kv_len / block_size] physical blocks, 0 = null block
    pad_index: torch.Tensor | None  # [num_rows] rows in the padded [P*q_len] layout; None = none
    query_pos: torch.Tensor  # [P, q_len] absolute position of each (padded) query
    num_keys: int | None = None  # one decoding request: it sees keys [0, num_keys), no mask
    first_block: int | None = None  # one request whose blocks are consecutive: no gather
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> mask
    # with AttentionMetadata.bf16_ops: each row one query of `CpuOps.attn_paged`, its keys
    # [num_rows] (position + 1) and its request [num_rows] (None: row i is request i)
    row_keys: torch.Tensor | None = None
    row_requests: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; shared by all layers."""

    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    groups: list[AttentionGroup]
    num_kv_groups: int  # query heads per KV head
    dtype: torch.dtype
    slot: int | None = None  # the one new token's slot (T == 1): written without index_copy_
    # a step of at most kernels.MAX_ROWS decoding requests on CPU in fp32: the decoder
    # layers run on the fused kernels (DecoderLayer.forward_decode) with these tensors
    cpu_ops: CpuOps | None = None
    positions: torch.Tensor | None = None  # [P] int64
    block_table: torch.Tensor | None = None  # [P, nblk] int64
    num_keys: torch.Tensor | None = None  # [P] int64: each request's keys incl. this token
    # with cpu_ops, the runner's plan to run every layer in one call (CpuOps.decode_layers)
    decode_plan: DecodePlan | None = None
    # any other step of a bf16 model on an AVX512-BF16 CPU: the decoder layers run their
    # small ops on these kernels (DecoderLayer.forward_bf16, `positions` set), and the
    # groups with `row_keys` attend on `CpuOps.attn_paged`, reading the blocks in place
    # where gather + SDPA copies every request's keys padded to the longest and masks
    bf16_ops: CpuOps | None = None
    # a step with rows of a LoRA adapter: each decoder layer adds the adapters' deltas to
    # its projections (engine.models.lora); None keeps the base path as it is
    lora: LoRAStep | None = None

    def mask(self, group: AttentionGroup, window: int | None) -> torch.Tensor:
        """Additive mask [P, 1, G*q_len, kv_len] for `window` (built once per step)."""
        m = group.masks.get(window)
        if m is None:
            m = build_mask(group.query_pos, group.kv_len, window, self.num_kv_groups, self.dtype)
            group.masks[window] = m
        return m


def build_mask(
    query_pos: torch.Tensor, kv_len: int, window: int | None, g: int, dtype: torch.dtype
) -> torch.Tensor:
    """Lower-right causal (+ window) additive mask; padded queries (pos < 0) see key 0 only."""
    p, q = query_pos.shape
    key = torch.arange(kv_len, device=query_pos.device)
    pos = query_pos[:, :, None]
    valid = key[None, None, :] <= pos
    if window is not None:
        valid &= key[None, None, :] > pos - window
    valid |= (pos < 0) & (key[None, None, :] == 0)
    mask = torch.zeros(valid.shape, dtype=dtype, device=query_pos.device)
    mask.masked_fill_(~valid, float("-inf"))
    if g > 1:
        mask = mask[:, None].expand(p, g, q, kv_len).reshape(p, g * q, kv_len)
    return mask[:, None]


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
) -> torch.Tensor:
    """q [T, Hq, D] and kv [T, 2*Hkv*D] (K then V) for this step's tokens -> [T, Hq, D]."""
    nb, bs = kv_cache.shape[:2]
    flat = kv_cache.view(nb * bs, kv.shape[1])
    if meta.slot is not None:  # one token: a view and a copy beat index_copy_ (~10 µs)
        flat[meta.slot].copy_(kv[0])
    else:
        flat.index_copy_(0, meta.slot_mapping, kv)
    if len(meta.groups) == 1 and meta.groups[0].num_rows == q.shape[0]:
        return _attend(q, kv_cache, meta, meta.groups[0], window)
    out = torch.empty_like(q)
    for grp in meta.groups:
        rows = slice(grp.row_start, grp.row_start + grp.num_rows)
        out[rows] = _attend(q[rows], kv_cache, meta, grp, window)
    return out


def _attend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    grp: AttentionGroup,
    window: int | None,
) -> torch.Tensor:
    """One group's attention: the paged kernel, a query row at a time, where `meta` has it
    and the group its rows' keys; else gather + SDPA."""
    ops = meta.bf16_ops
    if ops is None or grp.row_keys is None:
        return _group_attention(q, kv_cache, meta, grp, window)
    table = grp.block_index.view(grp.num_requests, -1)
    return ops.attn_paged(q, kv_cache, table, grp.row_keys, window, grp.row_requests)


def _group_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    grp: AttentionGroup,
    window: int | None,
) -> torch.Tensor:
    hkv, d = kv_cache.shape[3], kv_cache.shape[4]
    hq = q.shape[1]
    g = hq // hkv
    p, ql, kl = grp.num_requests, grp.q_len, grp.kv_len
    if grp.pad_index is not None:
        qp = q.new_zeros(p * ql, hq, d)
        qp.index_copy_(0, grp.pad_index, q)
        q = qp
    if grp.first_block is not None:  # consecutive blocks: read them in place
        kv = kv_cache.narrow(0, grp.first_block, kl // kv_cache.shape[1])
    else:
        kv = kv_cache.index_select(0, grp.block_index)
    kv = kv.view(p, kl, 2, hkv, d)
    mask: torch.Tensor | None = None
    if grp.num_keys is not None:  # one decoding request: its exact keys, no mask
        end = grp.num_keys
        kv = kv[:, 0 if window is None else max(0, end - window) : end]
    else:
        mask = meta.mask(grp, window)
    k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # [P, Hkv, keys, D] each
    if ql == 1 and grp.pad_index is None:  # decode: a KV head's G query heads are adjacent
        out = F.scaled_dot_product_attention(q.view(p, hkv, g, d), k, v, attn_mask=mask)
        return out.reshape(p, hq, d)
    # fold the G query heads of each KV head into query rows: [P, Hkv, G*Q, D]
    qg = q.view(p, ql, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(p, hkv, g * ql, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    out = out.view(p, hkv, g, ql, d).permute(0, 3, 1, 2, 4).reshape(p * ql, hq, d)
    if grp.pad_index is not None:
        out = out.index_select(0, grp.pad_index)
    return out
