"""Model runner: owns the paged KV cache and turns one `SchedulerOutput` into sampled tokens.

The torch side of the engine step (`engine.engine_core` calls `execute` once per step):
flat inputs (`engine.runner.inputs`) -> model forward over the paged cache -> logits for the
rows that sample -> (`engine.logits`, for rows with penalties, bias, min_tokens or a
grammar) -> `engine.sampler`. Loads a LoRA adapter into the slot the scheduler gave its
request when the slot holds another (`engine.models.lora`); an adapter that fails to
load fails its requests alone. Keeps one seeded `torch.Generator` per request whose
sampling params carry a seed, and one grammar matcher per constrained request, and drops
them when the scheduler reports the request finished.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from sluice.engine import kernels
from sluice.engine.block_quant import BlockQuantLinear
from sluice.engine.config import EngineConfig
from sluice.engine.core.outputs import (
    PromptLogprobsChunk,
    RunnerOutput,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
)
from sluice.engine.core.request import Request
from sluice.engine.errors import RequestRejectedError
from sluice.engine.logits import LogitsProcessor, output_token_ids, winding_up
from sluice.engine.lora import LoRAAdapterError, LoRAConfig, LoRARequest, read_lora_config
from sluice.engine.models.cpu_linear import (
    PackedLinear,
    native_low_precision,
    pack_linears,
)
from sluice.engine.models.llama import LlamaConfig, LlamaForCausalLM
from sluice.engine.models.lora import LoRAStep, LoRAWeights
from sluice.engine.options import EngineOptions
from sluice.engine.quantization import Int8Linear
from sluice.engine.runner.inputs import StepInputs, prepare_inputs
from sluice.engine.sampler import Sampler, greedy_tokens
from sluice.engine.sampling import SamplingParams, generator_seed
from sluice.engine.structured import GrammarCompiler, RequestMatcher, StructuredOutputError

logger = logging.getLogger(__name__)

# start-up time spent tuning the packed projections' row buckets and building their oneDNN
# primitives (`engine.models.cpu_linear.tune_row_buckets`), shared among the shapes: a
# bigger model tunes its smaller buckets and builds the rest on first use
WARM_BUDGET_S = 1.0

# prompt rows per lm_head call for prompt logprobs: 256 x a 49k vocab is 50 MB of fp32 logits
PROMPT_LOGPROBS_ROWS = 256

# adapter configs read (at submit, again at load): kept for this many adapters
LORA_CONFIG_CACHE = 256

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def compute_dtype(dtype: torch.dtype, device: torch.device, cpu_upcast: bool = True) -> torch.dtype:
    """The dtype the runner computes in: `dtype`, or fp32 for bf16/fp16 on a CPU that has
    no hardware support for them (emulated matmuls are several times slower there) unless
    `cpu_upcast` is off (`EngineOptions.cpu_upcast`)."""
    if device.type == "cpu" and not native_low_precision(dtype) and cpu_upcast:
        return torch.float32
    return dtype


def upcast(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Weights to `dtype` in place; the values stay those of the checkpoint's dtype (every
    bf16/fp16 value is exact in fp32). Int8 projections keep their int8 weights."""
    model.set_dtype(dtype)
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.set_output_dtype(dtype)


def _bf16_kernels_fit(cfg: LlamaConfig) -> bool:
    """Whether the bf16 kernels take this model's shapes (`CpuOps.attn_paged`: D a
    multiple of 32 up to 256, at most 16 query heads per KV head; the small ops: widths
    that are multiples of 16)."""
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    widths = (cfg.hidden_size, cfg.intermediate_size)
    return (
        cfg.head_dim % 32 == 0
        and cfg.head_dim <= 256
        and g <= 16
        and all(w % 16 == 0 for w in widths)
    )


def _fp32_decode_ready(model: LlamaForCausalLM) -> bool:
    """Whether every projection (and the lm_head) maps an fp32 input of a few rows to fp32:
    fp32 weights, a bf16 copy for the kernel (PackedLinear.small_weight), or int8 with the
    int8 kernel (Int8Linear.use_kernels) or an fp32 output (computing in fp32), or blocks
    (BlockQuantLinear)."""

    def fp32_out(proj: torch.nn.Module) -> bool:
        if isinstance(proj, PackedLinear):
            return proj.small_weight is not None or proj.packed.dtype == torch.float32
        if isinstance(proj, Int8Linear):
            return proj.ops is not None or proj.out_dtype == torch.float32
        if isinstance(proj, BlockQuantLinear):  # its result has its input's dtype
            return True
        return isinstance(proj, torch.nn.Linear) and proj.weight.dtype == torch.float32

    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    projections = [getattr(layer, n) for layer in model.layers for n in names]
    return all(fp32_out(p) for p in [*projections, model.lm_head])


class ModelRunner:
    """Runs `model` (already on `config.device` in `config.dtype`) over a paged KV cache.

    Computes in `compute_dtype(config.dtype)`: fp32 for a bf16/fp16 model on a CPU without
    native support for them, the weights upcast once here (twice the checkpoint's weight
    memory, and the projections keep a bf16 copy beside for the small-batch kernels).

    KV cache: per layer one tensor `[num_kv_blocks, block_size, 2, kv_heads, head_dim]` (K
    then V), block count from `config.resolve_num_kv_blocks` (block 0 is the null block).

    grammars: compiles structured-output constraints (None: a constrained request is
    refused). Each constrained request's matcher lives here from `add_request` until the
    scheduler reports it finished, so a preemption keeps it.
    """

    computes_prompt_logprobs = True  # `RunnerOutput.prompt_logprobs` (EngineCore asks)
    serves_lora = True  # `EngineRequest.lora_request` (EngineCore asks)

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig,
        options: EngineOptions | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        options = options or EngineOptions()
        self.model = model.eval().requires_grad_(False)
        # steps of many tokens on more threads (EngineOptions.prefill_threads)
        self._threads = self._step_threads = torch.get_num_threads()
        self._prefill_threads = options.prefill_threads if config.device == "cpu" else None
        self._prefill_min_tokens = options.prefill_min_tokens
        self.config = config
        self.device = torch.device(config.device)
        self.weights_dtype = torch_dtype(config.dtype)
        self.dtype = compute_dtype(self.weights_dtype, self.device, options.cpu_upcast)
        if self.dtype != self.weights_dtype:
            upcast(model, self.dtype)
        # flush denormals: random/small activations hit x87-speed denormal paths otherwise,
        # an order of magnitude slower decode
        torch.set_flush_denormal(True)
        self.num_packed = 0
        if self.device.type == "cpu" and options.prepack:
            names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
            # bf16 checkpoints keep a bf16 weight for the fused decode path (PackedLinear)
            small = torch.bfloat16 if self.weights_dtype == torch.bfloat16 else None
            self.num_packed = pack_linears(
                model,
                names,
                self.dtype,
                small_dtype=small,
                max_rows=config.max_num_batched_tokens,
                budget_s=WARM_BUDGET_S,
            )
        mc = model.config
        self.vocab_size = mc.vocab_size  # the ids its embedding holds (EngineCore checks)
        self.block_size = config.block_size
        self.num_kv_groups = mc.num_attention_heads // mc.num_key_value_heads
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_block = 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads
        self.bytes_per_block = per_block * mc.head_dim * itemsize
        self.num_kv_blocks = config.resolve_num_kv_blocks(self.bytes_per_block)
        # K and V of a slot side by side: one write and one gather per layer (attention.py)
        shape = (self.num_kv_blocks, self.block_size, 2, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(mc.num_hidden_layers)
        ]
        model.cache_rope(config.max_model_len)
        # the kernels (engine.kernels) need CPU and a precomputed RoPE table
        ops = kernels.cpu_ops() if self.device.type == "cpu" and model.has_rope_cache else None
        if ops is not None:
            for m in model.modules():
                if isinstance(m, (Int8Linear, BlockQuantLinear)):
                    m.use_kernels(ops)
        # fused small decode steps: projections that take the fp32 activations of that path
        # to an fp32 result
        self.cpu_ops = ops if _fp32_decode_ready(model) else None
        # their layers in one kernel call when every projection has a kernel form (the plan
        # holds this runner's KV caches: it is the runner's, not the model's)
        self.decode_plan = (
            None
            if self.cpu_ops is None
            else model.plan_decode(self.cpu_ops, self.kv_caches, self.block_size)
        )
        # any other step of a bf16 model: the bf16 kernels (AttentionMetadata.bf16_ops)
        bf16 = self.dtype == torch.bfloat16 and _bf16_kernels_fit(mc)
        self.bf16_ops = ops if ops is not None and ops.bf16_dot and bf16 else None
        self.sampler = Sampler(seed=config.seed)
        self._generators: dict[str, torch.Generator] = {}
        self.grammars = grammars
        # a constrained request's matcher: a future while its grammar compiles
        self._matchers: dict[str, RequestMatcher | Future[RequestMatcher]] = {}
        self._logits_processor = LogitsProcessor()
        # the adapters' slot weights, made when the first adapter loads
        self.lora_weights: LoRAWeights | None = None
        self._lora_ops = ops  # the adapters' deltas on the kernels (LoRAStep.for_rows)
        self._lora_configs: dict[LoRARequest, LoRAConfig] = {}

    def lora_config(self, lora: LoRARequest) -> LoRAConfig:
        """The adapter's checked config (read once); raises LoRAAdapterError."""
        config = self._lora_configs.get(lora)
        if config is None:
            config = read_lora_config(lora, self.config.max_lora_rank)
            if len(self._lora_configs) >= LORA_CONFIG_CACHE:
                self._lora_configs.pop(next(iter(self._lora_configs)))
            self._lora_configs[lora] = config
        return config

    def add_request(self, request: Request) -> None:
        """Start compiling a constrained request's grammar, off the engine thread; raises
        RequestRejectedError when there is no compiler or the grammar is known not to
        compile. Its resumed tokens (a failover or restart) are replayed into the matcher.
        An adapter whose config is unreadable or unsupported is refused here too."""
        if request.lora_request is not None:
            self.lora_config(request.lora_request)
        constraint = request.sampling_params.constraint
        if constraint is None:
            return
        if self.grammars is None:
            raise RequestRejectedError("structured outputs need the model's tokenizer")
        error = self.grammars.cached_error(constraint)
        if error is not None:
            raise RequestRejectedError(error)
        resumed = request.num_resumed_tokens
        replay = request.prompt_token_ids[-resumed:] if resumed else []
        self._matchers[request.request_id] = self.grammars.matcher_async(constraint, replay)

    def _drop(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        matcher = self._matchers.pop(request_id, None)
        if isinstance(matcher, Future):
            matcher.cancel()
        self._logits_processor.drop(request_id)

    def _set_threads(self, tokens: int) -> None:
        assert self._prefill_threads is not None
        want = self._prefill_threads if tokens >= self._prefill_min_tokens else self._threads
        if want != self._step_threads:
            torch.set_num_threads(want)  # the calling (engine) thread's OpenMP setting too
            self._step_threads = want

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        torch.set_flush_denormal(True)  # per thread: the engine loop may run in any thread
        for rid in scheduler_output.finished_request_ids:
            self._drop(rid)
        failed = self._load_adapters(scheduler_output)
        if failed:
            scheduler_output = _without(scheduler_output, failed)
        if self.lora_weights is not None:
            scheduler_output = _by_adapter(scheduler_output)
        if scheduler_output.is_empty:
            return RunnerOutput(failed=failed)
        if self._prefill_threads is not None:
            self._set_threads(scheduler_output.num_batched_tokens)
        with torch.inference_mode():
            inputs = prepare_inputs(
                scheduler_output,
                self.block_size,
                self.num_kv_groups,
                self.dtype,
                self.device,
                cpu_ops=self.cpu_ops,
                bf16_ops=self.bf16_ops,
            )
            lora = inputs.meta.lora = self._lora_step(scheduler_output)
            # the one-call decode plan adds adapters' deltas where the kernel takes them
            if inputs.meta.cpu_ops is not None and (lora is None or lora.kernel is not None):
                inputs.meta.decode_plan = self.decode_plan
            hidden = self.model.forward(
                inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches
            )
            prompt = self._prompt_logprobs(inputs, hidden) if inputs.prompt_rows else None
            out = self._sample(inputs, hidden) if inputs.sampling else RunnerOutput()
        if prompt:
            out.prompt_logprobs = prompt
        if failed:
            out.failed.update(failed)
        return out

    def _load_adapters(self, scheduler_output: SchedulerOutput) -> dict[str, str]:
        """Load each scheduled request's adapter into its slot where the slot holds
        another; returns the requests whose adapter failed to load -> why."""
        failed: dict[str, str] = {}
        errors: dict[LoRARequest, str] = {}
        for s in scheduler_output.scheduled:
            request = s.request
            lora, slot = request.lora_request, request.lora_slot
            if lora is None:
                continue
            assert slot is not None, "a request with an adapter is scheduled with its slot"
            weights = self.lora_weights
            if weights is not None and weights.loaded[slot] == lora:
                continue
            error = errors.get(lora)
            if error is None:
                try:
                    if weights is None:
                        # fp32 whatever the model computes in: torch's bf16 matmuls of
                        # these thin shapes are several times slower than its fp32 ones on CPU
                        weights = self.lora_weights = LoRAWeights(
                            self.model.config, self.config.max_loras, torch.float32, self.dtype
                        )
                    weights.load(slot, lora, self.lora_config(lora))
                    continue
                except LoRAAdapterError as exc:
                    error = errors[lora] = str(exc)
            failed[request.request_id] = error
        return failed

    def _lora_step(self, scheduler_output: SchedulerOutput) -> LoRAStep | None:
        """The step's adapters by flat row (decode rows first, then prefill chunks, as
        `prepare_inputs` lays them out), or None when no row has one."""
        weights = self.lora_weights
        scheduled = scheduler_output.scheduled
        if weights is None or all(s.request.lora_slot is None for s in scheduled):
            return None
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens != 1]
        rows: list[int] = []
        for s in decodes + prefills:
            slot = s.request.lora_slot
            rows += [-1 if slot is None else slot] * s.num_new_tokens
        return LoRAStep.for_rows(weights, rows, self._lora_ops)

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor) -> RunnerOutput:
        """The step's sampled tokens from the model's last hidden states."""
        if inputs.logits_indices is not None:
            hidden = hidden.index_select(0, inputs.logits_indices)
        params = [s.request.sampling_params for s in inputs.sampling]
        greedy = all(p.temperature == 0.0 and p.logprobs is None for p in params)
        processed = any(p.processes_logits for p in params)
        if processed and not (greedy and all(p.only_constrained for p in params)):
            logits = self.model.compute_logits(hidden, inputs.meta.cpu_ops, fp32=True)
            return self._sample_processed(inputs.sampling, params, logits.cpu())
        # a bf16 step's greedy rows: argmax over its bf16 logits, no fp32 copy of them
        bf16_argmax = self.bf16_ops if greedy and inputs.meta.cpu_ops is None else None
        logits = self.model.compute_logits(hidden, inputs.meta.cpu_ops, fp32=bf16_argmax is None)
        if greedy:
            # greedy without logprobs (the common case): argmax is all there is to do
            if bf16_argmax is not None:
                tokens = bf16_argmax.argmax_bf16(logits).tolist()
            else:
                tokens = greedy_tokens(logits.cpu()).tolist()
            if processed:
                return self._constrain_greedy(inputs.sampling, logits, tokens)
            return RunnerOutput(
                sampled=[
                    SampledToken(s.request_id, t)
                    for s, t in zip(inputs.sampling, tokens, strict=True)
                ]
            )
        gens = [
            self._generator(s.request_id, s.request.sampling_params.seed) for s in inputs.sampling
        ]
        out = self.sampler.sample(logits.cpu(), params, gens)
        return RunnerOutput(
            sampled=[
                SampledToken(s.request_id, out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
                for i, s in enumerate(inputs.sampling)
            ]
        )

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden: torch.Tensor
    ) -> dict[str, PromptLogprobsChunk]:
        """Raw log-softmax at each prompt row of the step (`StepInputs.prompt_rows`): the
        logprob and rank of the prompt token that follows, and the top alternatives. The
        rows go through the lm_head PROMPT_LOGPROBS_ROWS at a time, so a long prompt never
        holds all its logits (vocab x positions x 4 bytes) at once."""
        chunks: dict[str, PromptLogprobsChunk] = {}
        for s, first, n in inputs.prompt_rows:
            request = s.request
            k = request.sampling_params.prompt_logprobs or 0
            start = s.num_computed_tokens_before + 1  # the first prompt token scored
            targets = torch.tensor(request.prompt_token_ids[start : start + n], dtype=torch.int64)
            chunk = PromptLogprobsChunk(start, [], [], [])
            for a in range(0, n, PROMPT_LOGPROBS_ROWS):
                b = min(a + PROMPT_LOGPROBS_ROWS, n)
                logits = self.model.compute_logits(
                    hidden[first + a : first + b], inputs.meta.cpu_ops, fp32=True
                )
                lp = torch.log_softmax(logits.cpu(), dim=-1)
                chosen = lp.gather(1, targets[a:b, None])
                chunk.logprobs += chosen.squeeze(1).tolist()
                chunk.ranks += ((lp > chosen).sum(dim=1) + 1).tolist()
                if k:
                    top_v, top_i = lp.topk(k, dim=-1)
                    chunk.top_logprobs += [
                        list(zip(i, v, strict=True))
                        for i, v in zip(top_i.tolist(), top_v.tolist(), strict=True)
                    ]
                else:
                    chunk.top_logprobs += [[] for _ in range(b - a)]
            chunks[s.request_id] = chunk
        return chunks

    def _sample_processed(
        self,
        sampling: list[ScheduledRequest],
        params: list[SamplingParams],
        logits: torch.Tensor,
    ) -> RunnerOutput:
        """A step with rows whose logits `engine.logits` changes: process, then sample;
        constrained rows' matchers take the sampled tokens."""
        failed: dict[str, str] = {}
        matchers = self._ready_matchers(sampling, failed)
        raw = logits.clone() if any(p.logprobs is not None for p in params) else None
        rows = [i for i, p in enumerate(params) if p.processes_logits]
        self._logits_processor.apply(
            logits,
            rows,
            [sampling[i].request for i in rows],
            matchers,
            self.grammars.mask_words if self.grammars is not None else 0,
        )
        gens = [
            self._generator(s.request_id, p.seed) for s, p in zip(sampling, params, strict=True)
        ]
        out = self.sampler.sample(logits, params, gens, raw)
        return self._take(sampling, out.token_ids, out.logprobs, out.top_logprobs, matchers, failed)

    def _constrain_greedy(
        self, sampling: list[ScheduledRequest], logits: torch.Tensor, tokens: list[int]
    ) -> RunnerOutput:
        """A greedy step whose only processing is grammars: the raw argmax stands wherever
        the grammar takes it (a token's check costs µs, a mask tens); the other constrained
        rows (and those winding up) are masked in fp32 and take their masked argmax."""
        failed: dict[str, str] = {}
        matchers = self._ready_matchers(sampling, failed)
        redo = [
            i
            for i, s in enumerate(sampling)
            if (m := matchers.get(s.request_id)) is not None
            and m.active
            and (winding_up(s.request) or not m.accepts(tokens[i]))
        ]
        if redo:
            if logits.dtype == torch.float32:
                # numpy's gather: torch's may wake its thread pool, whose spinning helpers
                # slow the next step's fused decode kernels
                sub = torch.from_numpy(logits.cpu().numpy()[redo])
            else:  # a bf16 step, on that pool anyway: convert only the rows masked
                sub = logits[redo].float().cpu()
            self._logits_processor.apply(
                sub,
                list(range(len(redo))),
                [sampling[i].request for i in redo],
                matchers,
                self.grammars.mask_words if self.grammars is not None else 0,
            )
            for i, token_id in zip(redo, greedy_tokens(sub).tolist(), strict=True):
                tokens[i] = token_id
        none: list[None] = [None] * len(tokens)
        return self._take(sampling, tokens, none, none, matchers, failed)

    def _take(
        self,
        sampling: list[ScheduledRequest],
        tokens: Sequence[int],
        logprobs: Sequence[float | None],
        tops: Sequence[list[tuple[int, float]] | None],
        matchers: dict[str, RequestMatcher],
        failed: dict[str, str],
    ) -> RunnerOutput:
        """The step's sampled tokens, each constrained row's consumed by its matcher (a
        grammar that completes ends its request; one that errs fails it alone)."""
        sampled: list[SampledToken] = []
        for i, s in enumerate(sampling):
            if s.request_id in failed:
                continue
            token_id = tokens[i]
            matcher = matchers.get(s.request_id)
            stop = matcher.consume(token_id) if matcher is not None else False
            if matcher is not None and matcher.error is not None:
                failed[s.request_id] = f"structured output failed: {matcher.error}"
                continue
            sampled.append(SampledToken(s.request_id, token_id, logprobs[i], tops[i], stop))
        return RunnerOutput(sampled=sampled, failed=failed)

    def _ready_matchers(
        self, sampling: list[ScheduledRequest], failed: dict[str, str]
    ) -> dict[str, RequestMatcher]:
        """The step's constrained requests' matchers, each caught up with its output (a
        compile still running is waited for: once, in the first step that samples it)."""
        ready: dict[str, RequestMatcher] = {}
        for s in sampling:
            request = s.request
            constraint = request.sampling_params.constraint
            if constraint is None:
                continue
            rid = request.request_id
            entry = self._matchers.get(rid)
            try:
                if entry is None:  # not added through add_request (a runner driven directly)
                    self.add_request(request)
                    entry = self._matchers[rid]
                if isinstance(entry, Future):
                    entry = self._matchers[rid] = entry.result()
            except (StructuredOutputError, RequestRejectedError) as exc:
                failed[rid] = str(exc)
                continue
            total = request.num_resumed_tokens + len(request.output_token_ids)
            if entry.num_consumed != total:
                entry.sync(output_token_ids(request))
            ready[rid] = entry
        return ready

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator()
            g.manual_seed(generator_seed(seed))
            self._generators[request_id] = g
        return g


def _without(scheduler_output: SchedulerOutput, request_ids: dict[str, str]) -> SchedulerOutput:
    """The step without `request_ids`' rows (they failed before running)."""
    kept = [s for s in scheduler_output.scheduled if s.request_id not in request_ids]
    return SchedulerOutput(
        kept,
        sum(s.num_new_tokens for s in kept),
        scheduler_output.preempted_request_ids,
        scheduler_output.finished_request_ids,
    )


def _by_adapter(scheduler_output: SchedulerOutput) -> SchedulerOutput:
    """The step with its requests ordered by adapter slot (the base first), so each
    adapter's rows are runs (`LoRAStep.segments`); sampled tokens come out in this order."""
    scheduled = scheduler_output.scheduled
    slots = [-1 if s.request.lora_slot is None else s.request.lora_slot for s in scheduled]
    order = sorted(range(len(scheduled)), key=slots.__getitem__)
    if order == list(range(len(scheduled))):
        return scheduler_output
    return SchedulerOutput(
        [scheduled[i] for i in order],
        scheduler_output.num_batched_tokens,
        scheduler_output.preempted_request_ids,
        scheduler_output.finished_request_ids,
    )
