"""Argument checks of the kernel bindings: each tensor's device, dtype, layout and shape
once a call, and the one table from the C return codes to errors.

The C functions take raw pointers and sizes, so a tensor of the wrong dtype, shape or
layout would be read (or written) past its end; the checks raise a `ValueError` naming
the argument instead. Ids inside tensors (block ids, slots, positions) are checked by the
C code itself, once a row, and come back as the return codes below."""

from __future__ import annotations

from collections.abc import Sequence

import torch

F32: tuple[torch.dtype, ...] = (torch.float32,)
BF16: tuple[torch.dtype, ...] = (torch.bfloat16,)
I64: tuple[torch.dtype, ...] = (torch.int64,)
I8: tuple[torch.dtype, ...] = (torch.int8,)
U8: tuple[torch.dtype, ...] = (torch.uint8,)
F32_BF16: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)

# cpu_ops.c's return codes (its SLUICE_E_* enum): the exception and what it means
ERRORS: dict[int, tuple[type[Exception], str]] = {
    -1: (ValueError, "a row count, mode or shape the kernel does not take"),
    -2: (MemoryError, "a scratch allocation failed"),
    -3: (RuntimeError, "a row's num_keys is below 1 or beyond the block table row"),
    -4: (RuntimeError, "a block id in the block table is outside the KV cache's blocks"),
    -5: (RuntimeError, "a slot id is outside the KV cache's slots (blocks * block size)"),
    -6: (RuntimeError, "a row's request index is beyond the block table's rows"),
    -7: (RuntimeError, "a position is outside the RoPE table"),
}


def error(op: str, rc: int) -> Exception:
    """The error of kernel `op`'s nonzero return code `rc`."""
    kind, what = ERRORS.get(rc, (RuntimeError, "an unknown failure"))
    return kind(f"{op} failed ({rc}): {what}")


def tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    shape: Sequence[int | None],
    *,
    rows: bool = False,
) -> torch.Size:
    """`t`'s shape after checking it is a CPU tensor of one of `dtypes`, `shape` (None:
    any size) and contiguous, or with `rows` only each row (dims after the first)
    contiguous, rows apart by at least a row; raises ValueError naming `op` and `name`."""
    # runs on every kernel call: a plain loop (no generator, no zip), and no
    # isinstance (whatever lacks a tensor's attributes fails below)
    try:
        s = t.shape
        if t.dtype in dtypes and t.is_cpu and len(s) == len(shape):
            for i, want in enumerate(shape):
                if want is not None and want != s[i]:
                    break
            else:
                if _rows_contiguous(t) if rows else t.is_contiguous():
                    return s
    except AttributeError:
        pass
    raise ValueError(f"{op}: {name} {_problem(t, dtypes, shape, rows)}")


def _rows_contiguous(t: torch.Tensor) -> bool:
    if t.is_contiguous():
        return True
    size, stride = t.shape, t.stride()
    step = 1
    for i in range(len(size) - 1, 0, -1):
        if size[i] != 1 and stride[i] != step:
            return False
        step *= size[i]
    return size[0] <= 1 or stride[0] >= step


def _problem(
    t: object, dtypes: tuple[torch.dtype, ...], shape: Sequence[int | None], rows: bool
) -> str:
    """What is wrong with `t`, the first thing `tensor` found."""
    if not isinstance(t, torch.Tensor):
        return f"must be a tensor, got {type(t).__name__}"
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"must be {names}, got {str(t.dtype).removeprefix('torch.')}"
    if not t.is_cpu:
        return f"must be on the CPU, got {t.device}"
    want = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
    if len(t.shape) != len(shape) or any(
        w is not None and w != g for w, g in zip(shape, t.shape, strict=False)
    ):
        return f"must be shaped {want}, got {list(t.shape)}"
    if rows:
        return f"must have contiguous rows, got strides {t.stride()}"
    return f"must be contiguous, got strides {t.stride()} for shape {list(t.shape)}"


def bad(op: str, what: str) -> ValueError:
    """The error of a size or shape kernel `op` cannot take (the caller raises it, so a
    passing call formats no message)."""
    return ValueError(f"{op}: {what}")
