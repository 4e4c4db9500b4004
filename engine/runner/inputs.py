"""Flat batched model inputs for one step, built from a `SchedulerOutput` (runner side).

Turns the scheduler's plan into flat tensors: token ids, positions, KV slots, and the
attention groups of `engine.runner.attention`. Rows are reordered so decode requests (one
new token) come first and prefill chunks after; `logits_indices` points at the last row of
each request that samples, in the scheduler's order, so sampled outputs keep its order.
`prompt_rows` are the rows whose logits score the next prompt token, for requests that
want prompt logprobs.
Built with numpy and Python lists: no per-request torch ops (each costs ~10 µs on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sluice.engine import kernels
from sluice.engine.core.outputs import ScheduledRequest, SchedulerOutput
from sluice.engine.runner.attention import AttentionGroup, AttentionMetadata


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor | None  # [N] rows whose hidden state is sampled; None = all
    sampling: list[ScheduledRequest]  # the N requests that sample, scheduler order
    # requests whose chunk scores prompt tokens (`Request.wants_prompt_logprobs`): (the
    # request, its first row, how many rows from there score the next prompt token)
    prompt_rows: list[tuple[ScheduledRequest, int, int]] = field(default_factory=list)


def prepare_inputs(
    sched: SchedulerOutput,
    block_size: int,
    num_kv_groups: int,
    dtype: torch.dtype,
    device: torch.device,
    cpu_ops: kernels.CpuOps | None = None,
    bf16_ops: kernels.CpuOps | None = None,
) -> StepInputs:
    """`cpu_ops`: use the fused decode kernels when this step is only decodes (at most
    kernels.MAX_ROWS of them); the runner passes them on CPU (model_runner._fp32_decode_ready).
    `bf16_ops`: otherwise the layers run on the bf16 kernels (`AttentionMetadata.bf16_ops`;
    the runner passes them for a bf16 model on a CPU with AVX512-BF16)."""
    decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
    prefills = [s for s in sched.scheduled if s.num_new_tokens != 1]
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    last_row: dict[str, int] = {}
    groups: list[AttentionGroup] = []

    # decode rows: inlined list building, this runs for every request every step
    if decodes:
        nblk = [(s.num_computed_tokens_before + block_size) // block_size for s in decodes]
        width = max(nblk)
        table = np.zeros((len(decodes), width), dtype=np.int64)
        qpos = np.empty((len(decodes), 1), dtype=np.int64)
        for i, s in enumerate(decodes):
            p = s.num_computed_tokens_before
            ids.append(s.request.token_ids_slice(p, p + 1)[0])
            pos.append(p)
            slots.append(s.block_ids[p // block_size] * block_size + p % block_size)
            table[i, : nblk[i]] = s.block_ids[: nblk[i]]
            qpos[i, 0] = p
            last_row[s.request_id] = i
        groups.append(
            AttentionGroup(
                row_start=0,
                num_rows=len(decodes),
                num_requests=len(decodes),
                q_len=1,
                kv_len=width * block_size,
                block_index=torch.from_numpy(table.reshape(-1)).to(device),
                pad_index=None,
                query_pos=torch.from_numpy(qpos).to(device),
                num_keys=pos[0] + 1 if len(decodes) == 1 else None,
                first_block=_first_if_consecutive(decodes[0].block_ids[: nblk[0]])
                if len(decodes) == 1
                else None,
            )
        )
    if prefills:
        groups.append(
            _prefill_group(prefills, block_size, len(ids), ids, pos, slots, last_row, device)
        )

    logits_rows = [last_row[s.request_id] for s in sched.scheduled if s.sample]
    every_row = len(logits_rows) == len(ids) and logits_rows == list(range(len(ids)))
    # ids, positions and slots in one tensor: one torch op instead of three
    rows = torch.tensor([ids, pos, slots], dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        slot_mapping=rows[2],
        groups=groups,
        num_kv_groups=num_kv_groups,
        dtype=dtype,
        slot=slots[0] if len(slots) == 1 else None,
    )
    if cpu_ops is not None and not prefills and len(decodes) <= kernels.MAX_ROWS:
        meta.cpu_ops, meta.positions = cpu_ops, rows[1]
        meta.block_table = groups[0].block_index.view(len(decodes), -1)
        meta.num_keys = groups[0].query_pos.view(-1) + 1
    elif bf16_ops is not None:
        meta.bf16_ops, meta.positions = bf16_ops, rows[1]
        # every group attends a row at a time on the paged kernel: a prefill chunk's rows
        # too, where SDPA pays a padded, masked gather
        for grp in groups:
            grp.row_keys = rows[1, grp.row_start : grp.row_start + grp.num_rows] + 1
        if prefills:
            counts = torch.tensor([s.num_new_tokens for s in prefills])
            groups[-1].row_requests = torch.arange(len(prefills)).repeat_interleave(counts)
    prompt_rows: list[tuple[ScheduledRequest, int, int]] = []
    for s in sched.scheduled:
        if s.request.wants_prompt_logprobs:
            # row for position p scores prompt token p + 1; the last prompt position
            # predicts the first output token instead
            start = s.num_computed_tokens_before
            n = min(start + s.num_new_tokens, s.request.num_prompt_tokens - 1) - start
            if n > 0:
                prompt_rows.append((s, last_row[s.request_id] - s.num_new_tokens + 1, n))
    return StepInputs(
        input_ids=rows[0],
        positions=rows[1],
        meta=meta,
        logits_indices=None
        if every_row  # e.g. pure decode: no gather needed
        else torch.tensor(logits_rows, dtype=torch.int64, device=device),
        sampling=[s for s in sched.scheduled if s.sample],
        prompt_rows=prompt_rows,
    )


def _first_if_consecutive(blocks: list[int]) -> int | None:
    """blocks[0] when `blocks` are b, b+1, b+2, ... (then they are one slice of the cache)."""
    b = blocks[0]
    if blocks[-1] - b == len(blocks) - 1 and blocks == list(range(b, b + len(blocks))):
        return b
    return None


def _prefill_group(
    prefills: list[ScheduledRequest],
    block_size: int,
    row_start: int,
    ids: list[int],
    pos: list[int],
    slots: list[int],
    last_row: dict[str, int],
    device: torch.device,
) -> AttentionGroup:
    """Append prefill chunks' rows and describe them as one padded attention group."""
    q_len = max(s.num_new_tokens for s in prefills)
    ends = [s.num_computed_tokens_before + s.num_new_tokens for s in prefills]
    width = max((e + block_size - 1) // block_size for e in ends)
    table = np.zeros((len(prefills), width), dtype=np.int64)
    qpos = np.full((len(prefills), q_len), -1, dtype=np.int64)
    pad_rows: list[np.ndarray] = []
    row = row_start
    for i, s in enumerate(prefills):
        start, n = s.num_computed_tokens_before, s.num_new_tokens
        p = np.arange(start, start + n, dtype=np.int64)
        blocks = np.asarray(s.block_ids[: (start + n + block_size - 1) // block_size], np.int64)
        table[i, : len(blocks)] = blocks
        ids.extend(s.request.token_ids_slice(start, start + n))
        pos.extend(p.tolist())
        slots.extend((blocks[p // block_size] * block_size + p % block_size).tolist())
        qpos[i, :n] = p
        pad_rows.append(np.arange(i * q_len, i * q_len + n, dtype=np.int64))
        row += n
        last_row[s.request_id] = row - 1
    num_rows = row - row_start
    padded = len(prefills) * q_len != num_rows
    return AttentionGroup(
        row_start=row_start,
        num_rows=num_rows,
        num_requests=len(prefills),
        q_len=q_len,
        kv_len=width * block_size,
        block_index=torch.from_numpy(table.reshape(-1)).to(device),
        pad_index=torch.from_numpy(np.concatenate(pad_rows)).to(device) if padded else None,
        query_pos=torch.from_numpy(qpos).to(device),
    )
