"""LoRA adapters inside the model's fused projections: slot weights and the batched delta.

The runner keeps one `LoRAWeights` (made when the first adapter loads) and, in a step
whose batch has rows of an adapter, hands the decoder layers a `LoRAStep`. For each
fused projection (qkv, o, gate_up, down) every slot's A matrices are stacked rank-major
into one `[parts * rank * slots, in]` tensor and the B matrices (scale folded in) into
one `[parts * rank * slots, out]`, zero outside each part's columns, so a step of any mix
of adapters and the base model costs a few ops per projection:

    xa = x @ A_all^T                 every slot's low-rank input, [rows, parts*rank*slots]
    xa *= mask                       a row keeps only its own slot's columns (base: none)
    y += xa @ B_all                  B_all block-diagonal over the parts, [parts*rank*slots, out]

That is four ops per projection whatever the mix, for a step of few rows, which pays
per op rather than per flop. A step of many rows pays for the other slots' columns
(slots times the flops), so there the runner orders the step's requests by slot and each
run of rows of one adapter does `y[run] += (x[run] @ A_slot^T) @ B_slot` on its slot's
strided view of the same tensors (`LoRAStep.segments`).
With the CPU kernels (`engine.kernels`), a step instead makes one `CpuOps.lora_add` call a
projection over the same tensors (`LoRAWeights.kernel_plan`), each row by its own slot,
and a small decode step adds the deltas inside the one-call `CpuOps.decode_layers` (its
projections' LoRA pointers and the rows' slots). A model computing in bf16 on a CPU with
AVX512-BF16 also keeps bf16 copies of A and B (`FusedLoRA.a16`, `b16`, kept in step by
`set_slot`), which the kernel's vdpbf16ps form reads for bf16 rows.
No merged weights: the base projections run as they do without adapters. The rank
dimension is the largest rank loaded so far (smaller ranks are zero-padded), grown as
bigger adapters arrive, up to `max_lora_rank`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from sluice.engine.kernels import LORA_COLS, CpuOps, LoRAPlan, LoRAProj, LoRARows
from sluice.engine.lora import WEIGHTS_FILE, LoRAAdapterError, LoRAConfig, LoRARequest
from sluice.engine.models.llama import LlamaConfig, interleave_rope_rows

logger = logging.getLogger(__name__)

# a step of at most this many rows computes its adapters' deltas on the engine thread
# alone: waking torch's thread pool for a few-row matmul costs more than it saves, and its
# spinning helpers contend with the decode kernels' threads (and stall whenever the host
# is busy: a barrier waits for a helper that is not running)
SERIAL_ROWS = 256

# fused projection -> the Hugging Face modules it holds, in output order
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_PART_OF = {p: (fused, i) for fused, parts in FUSED_PARTS.items() for i, p in enumerate(parts)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def module_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each Hugging Face projection."""
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


class FusedLoRA:
    """One fused projection's adapter weights, every slot: A rank-major `[P, R, S, in]`
    and B `[P, R, S, out]` (zero outside part p's columns), both viewed flat; column c of
    `x @ A^T` is slot c % S."""

    def __init__(
        self, in_features: int, out_sizes: list[int], num_slots: int, rank: int, dtype: torch.dtype
    ) -> None:
        self.in_features, self.out_sizes, self.num_slots = in_features, out_sizes, num_slots
        self.rank = 0
        self.dtype = dtype
        self.out_features = sum(out_sizes)
        self.a = torch.zeros((0, in_features), dtype=dtype)
        self.b = torch.zeros((0, self.out_features), dtype=dtype)
        self.offsets = [sum(out_sizes[:p]) for p in range(len(out_sizes))]
        self.targeted = [0] * num_slots  # per slot, whether its adapter targets this
        # bf16 copies of A and B for the kernel's vdpbf16ps form (`kernel_proj(bf16=True)`),
        # kept in step with them by `set_slot` once made
        self.a16: torch.Tensor | None = None
        self.b16: torch.Tensor | None = None
        self.grow(rank)

    @property
    def active(self) -> bool:
        return any(self.targeted)

    def grow(self, rank: int) -> None:
        """Widen the rank dimension to `rank`, keeping every slot's weights."""
        if rank <= self.rank:
            return
        parts, s, old = len(self.out_sizes), self.num_slots, self.rank
        a = torch.zeros((parts, rank, s, self.in_features), dtype=self.dtype)
        a[:, :old] = self.a.view(parts, old, s, self.in_features)
        self.a = a.view(parts * rank * s, self.in_features)
        b = torch.zeros((parts, rank, s, self.out_features), dtype=self.dtype)
        b[:, :old] = self.b.view(parts, old, s, self.out_features)
        self.b = b.view(parts * rank * s, self.out_features)
        self.rank = rank
        self.a16 = self.b16 = None  # remade at the new rank by the next `kernel_proj`

    def set_slot(
        self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None
    ) -> None:
        """Slot `slot`'s `part`: A `[r, in]`, B `[out_p, r]` (scaled); None clears it."""
        parts, r_all, s = len(self.out_sizes), self.rank, self.num_slots
        off, n = self.offsets[part], self.out_sizes[part]
        a_view = self.a.view(parts, r_all, s, self.in_features)[part, :, slot]
        b_view = self.b.view(parts, r_all, s, self.out_features)[part, :, slot, off : off + n]
        a_view.zero_()
        b_view.zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            a_view[:r] = a
            b_view[:r] = b.t()
        if self.a16 is not None and self.b16 is not None:
            shape = (parts, r_all, s)
            self.a16.view(*shape, self.in_features)[part, :, slot] = a_view
            b_slot = self.b.view(*shape, self.out_features)[part : part + 1, :, slot : slot + 1]
            self.b16[part : part + 1, :, slot : slot + 1] = _rank_pairs(b_slot)

    def kernel_proj(self, bf16: bool = False) -> LoRAProj | None:
        """These weights as `CpuOps.lora_add` reads them (views: a slot loaded or cleared
        later is seen), or None when no adapter targets this projection; `bf16`: with the
        bf16 copies of its vdpbf16ps form, made on first use."""
        if not self.active or self.dtype != torch.float32:
            return None
        shape = (len(self.out_sizes), self.rank, self.num_slots)
        b = self.b.view(*shape, self.out_features)
        if bf16 and (self.a16 is None or self.b16 is None):
            # made in a step (inference mode), written by `set_slot` outside one
            with torch.inference_mode(False):
                self.a16 = self.a.view(*shape, self.in_features).to(torch.bfloat16)
                self.b16 = _rank_pairs(b)
        return LoRAProj(
            self.a.view(*shape, self.in_features),
            b,
            tuple(self.out_sizes),
            torch.tensor(self.targeted, dtype=torch.uint8),
            self.a16 if bf16 else None,
            self.b16 if bf16 else None,
        )

    def add_rows(self, x: torch.Tensor, y: torch.Tensor, slot: int, start: int, end: int) -> None:
        """y[start:end] += slot `slot`'s delta of x[start:end]."""
        if not self.targeted[slot]:
            return
        rows = len(self.out_sizes) * self.rank
        # the slot's rows of A and B: every S-th row of the flat tensors (one stride)
        a = self.a.view(rows, self.num_slots, self.in_features)[:, slot]
        b = self.b.view(rows, self.num_slots, self.out_features)[:, slot]
        xs = x[start:end]
        if xs.dtype != self.dtype:
            xs = xs.to(self.dtype)
        xa = torch.mm(xs, a.t())
        ys = y[start:end]
        if ys.dtype == self.dtype:
            ys.addmm_(xa, b)
        else:
            ys.add_(torch.mm(xa, b))

    def add(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> None:
        """y += each row's own slot's delta (x: the projection's input, y: its output,
        or a tensor it was added into; mask: `LoRAStep.mask`)."""
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        xa = torch.mm(x, self.a.t()).mul_(mask)
        if y.dtype == self.dtype:
            y.addmm_(xa, self.b)
        else:
            y.add_(torch.mm(xa, self.b))


def _rank_pairs(b: torch.Tensor) -> torch.Tensor:
    """fp32 B [P, R, S, N] -> bf16 [P, (R + 1) / 2, S, N, 2], ranks 2i and 2i + 1 side by
    side (the pairs `vdpbf16ps` multiplies; an odd rank's last pair zero-padded)."""
    parts, rank, slots, n = b.shape
    if rank % 2:
        b = torch.cat([b, b.new_zeros(parts, 1, slots, n)], dim=1)
    pairs = b.view(parts, (rank + 1) // 2, 2, slots, n).permute(0, 1, 3, 4, 2)
    return pairs.to(torch.bfloat16).contiguous()


class LoRAWeights:
    """Every layer's `FusedLoRA`s and which adapter each slot holds (the runner's)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        num_slots: int,
        dtype: torch.dtype,
        activations: torch.dtype = torch.float32,
    ) -> None:
        self.config = cfg
        self.num_slots = num_slots
        self.dtype = dtype
        # the dtype the model computes in: bf16 activations take the kernel's vdpbf16ps form
        self.activations = activations
        self.rank = 0
        self.loaded: list[LoRARequest | None] = [None] * num_slots
        self.shapes = module_shapes(cfg)
        # the kernels' description of these weights (`kernel_plan`), rebuilt after a load
        # or clear: a grown rank reallocates the tensors, and `targeted` changes
        self._plan: LoRAPlan | None = None
        self._plan_stale = True
        self.layers: list[dict[str, FusedLoRA]] = []
        for _ in range(cfg.num_hidden_layers):
            fused = {}
            for name, parts in FUSED_PARTS.items():
                fused[name] = FusedLoRA(
                    self.shapes[parts[0]][0],
                    [self.shapes[p][1] for p in parts],
                    num_slots,
                    0,
                    dtype,
                )
            self.layers.append(fused)

    def load(self, slot: int, lora: LoRARequest, config: LoRAConfig) -> None:
        """Read the adapter's weights into `slot` (evicting what it held); raises
        LoRAAdapterError when the file does not fit this model, leaving the slot empty."""
        self.clear(slot)
        tensors = self._read(lora, config)
        if config.rank > self.rank:
            for fused in self._all():
                fused.grow(config.rank)
            self.rank = config.rank
        cfg = self.config
        for (layer, module), (a, b) in tensors.items():
            fused_name, part = _PART_OF[module]
            if module in ("q_proj", "k_proj"):  # the engine's q/k rows are RoPE-interleaved
                heads = cfg.num_attention_heads if module == "q_proj" else cfg.num_key_value_heads
                b = interleave_rope_rows(b, heads, cfg.head_dim)
            fused = self.layers[layer][fused_name]
            fused.set_slot(slot, part, a, b * config.scale)
            fused.targeted[slot] = 1
        self.loaded[slot] = lora
        self._plan_stale = True
        logger.info("adapter %s loaded into slot %s (rank %s)", lora.name, slot, config.rank)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            for name, fused in layer.items():
                if fused.targeted[slot]:
                    for part in range(len(FUSED_PARTS[name])):
                        fused.set_slot(slot, part, None, None)
                    fused.targeted[slot] = 0
        self.loaded[slot] = None
        self._plan_stale = True

    def kernel_plan(self, ops: CpuOps) -> LoRAPlan | None:
        """Every layer's qkv, o, gate_up and down adapters for `ops.lora_add` and
        `ops.decode_layers`, or None when the kernel does not take them (not fp32, or
        parts * rank over its `LORA_COLS`)."""
        if self._plan_stale:
            self._plan_stale = False
            fits = self.dtype == torch.float32 and 3 * self.rank <= LORA_COLS
            bf16 = fits and ops.bf16_dot and self.activations == torch.bfloat16
            projs = [fused.kernel_proj(bf16) for fused in self._all()]
            self._plan = ops.lora_plan(projs, self.num_slots) if fits else None
        return self._plan

    def _all(self) -> list[FusedLoRA]:
        return [fused for layer in self.layers for fused in layer.values()]

    def _read(
        self, lora: LoRARequest, config: LoRAConfig
    ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """(layer, module) -> (A, B) in this engine's dtype, every shape checked."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = f"{lora.path}/{WEIGHTS_FILE}"
        try:
            raw = load_file(path)
        except (OSError, SafetensorError) as exc:
            raise LoRAAdapterError(f"adapter {lora.name!r}: cannot read {path}: {exc}") from None
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in raw.items():
            m = _KEY.search(key)
            if m is None:
                raise LoRAAdapterError(
                    f"adapter {lora.name!r}: tensor {key!r} is not a LoRA A/B of a "
                    f"projection this engine serves"
                )
            layer, module, which = int(m[1]), m[2], m[3]
            if module not in config.target_modules or layer >= self.config.num_hidden_layers:
                raise LoRAAdapterError(
                    f"adapter {lora.name!r}: tensor {key!r} does not fit the model "
                    f"({self.config.num_hidden_layers} layers, targets "
                    f"{sorted(config.target_modules)})"
                )
            halves.setdefault((layer, module), {})[which] = tensor
        out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, module), ab in halves.items():
            a, b = ab.get("A"), ab.get("B")
            fan_in, fan_out = self.shapes[module]
            want_a, want_b = (config.rank, fan_in), (fan_out, config.rank)
            if a is None or b is None or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                got = [None if t is None else tuple(t.shape) for t in (a, b)]
                raise LoRAAdapterError(
                    f"adapter {lora.name!r}: layer {layer} {module}: A/B shapes {got}, "
                    f"expected {want_a} and {want_b} for this model at r={config.rank}"
                )
            out[(layer, module)] = (a.to(self.dtype), b.to(self.dtype))
        return out


_INDEX = {name: i for i, name in enumerate(FUSED_PARTS)}

# rows per run of one adapter from which a step computes per run rather than masked: a
# run costs two or three ops per projection, the mask every slot's columns for each row
SEGMENT_ROWS = 8


@dataclass(slots=True)
class LoRAStep:
    """One step's adapters, by flat row: `kernel`, every row's slot for `CpuOps.lora_add`
    (one call a projection, inside `decode_layers` too); else either `segments`, the runs
    of rows of one slot (start, end, slot), or `onehot` [rows, slots] (1 where a row's slot
    is), from which the per-width masks are built on first use by a layer and shared by
    the others."""

    weights: LoRAWeights
    onehot: torch.Tensor | None
    segments: list[tuple[int, int, int]] | None
    serial: bool  # SERIAL_ROWS or fewer: the deltas on this thread alone
    kernel: LoRARows | None = None
    ops: CpuOps | None = None
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def for_rows(
        cls, weights: LoRAWeights, row_slots: list[int], ops: CpuOps | None = None
    ) -> LoRAStep:
        """`row_slots[i]`: the slot of flat row i (-1: the base model); `ops`: the
        kernels, which compute every step's deltas where they take the weights: one call a
        projection where torch takes a few ops per run of rows (a prefill with torch's
        thin matmuls, a oneDNN primitive per new row count, cost over three times the
        kernel's)."""
        num_rows = len(row_slots)
        serial = num_rows <= SERIAL_ROWS
        plan = None if ops is None else weights.kernel_plan(ops)
        if plan is not None:
            rows = LoRARows(plan, torch.tensor(row_slots, dtype=torch.int64))
            return cls(weights, None, None, serial, rows, ops)
        runs: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, num_rows + 1):
            if i == num_rows or row_slots[i] != row_slots[start]:
                if row_slots[start] >= 0:
                    runs.append((start, i, row_slots[start]))
                start = i
        if num_rows >= SEGMENT_ROWS * len(runs):
            return cls(weights, None, runs, serial)
        slots = torch.tensor(row_slots, dtype=torch.int64)
        onehot = torch.zeros((num_rows, weights.num_slots + 1), dtype=weights.dtype)
        onehot.scatter_(1, (slots + 1)[:, None], 1.0)  # column 0: the base rows
        return cls(weights, onehot[:, 1:].contiguous(), None, serial)

    def mask(self, parts: int) -> torch.Tensor:
        m = self._masks.get(parts)
        if m is None:
            assert self.onehot is not None
            m = self._masks[parts] = self.onehot.repeat(1, parts * self.weights.rank)
        return m

    def add(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += the LoRA delta of layer `layer`'s projection `name` at input x."""
        fused = self.weights.layers[layer][name]
        if not fused.active:
            return
        kernel = self.kernel
        if kernel is not None:
            assert self.ops is not None
            index = len(FUSED_PARTS) * layer + _INDEX[name]
            out = y if y.is_contiguous() else y.contiguous()
            # serial in a small step: between the base projections' oneDNN calls torch's
            # pool threads still spin on the other cores, and the kernel's helper waits
            # for one of them to yield its core
            self.ops.lora_add(
                kernel.plan, index, x.contiguous(), out, kernel.row_slots, self.serial
            )
            if out is not y:
                y.copy_(out)
            return
        threads = torch.get_num_threads()
        if self.serial:
            torch.set_num_threads(1)  # this thread's setting: a fraction of a µs each way
        try:
            if self.segments is not None:
                for start, end, slot in self.segments:
                    fused.add_rows(x, y, slot, start, end)
            else:
                fused.add(x, y, self.mask(len(fused.out_sizes)))
        finally:
            if self.serial:
                torch.set_num_threads(threads)
