"""LoRA adapters in the torch engine (tiny-llama preset, fp32), against HF + PEFT.

Random PEFT adapters (A and B drawn, B non-zero) on the preset's weights: greedy tokens
equal PEFT's, unmerged and merged; one batch mixing four adapters and the base equals
each request run alone, prefill chunks and decodes together; with max_loras=2 four
adapters are evicted and loaded again on demand; the prefix cache never shares blocks
across adapters; an adapter that cannot load fails its request alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.engine.backends.base import EngineDelta, EngineRequest, LoRARequest
from sluice.engine.config import EngineConfig
from sluice.engine.engine_core import EngineCore
from sluice.engine.errors import RequestRejectedError
from sluice.engine.loader import LoadedModel, load_model, resolve_model_dir
from sluice.engine.lora import LoRAAdapterError, read_lora_config
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.sampling import SamplingParams
from tests.unit.engine.invariants import check_all_returned
from tests.unit.engine.lora_adapters import make_adapter, peft_greedy

pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TEXTS = [
    "Hello, world. How are you today? I am fine, thank you.",
    "Engines batch requests, schedule tokens",
    "the quick brown fox jumps over the lazy dog",
    "Hello, world. How are you today? What is the weather like?",
    "LoRA adapters share one base model",
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(2)
    return resolve_model_dir("tiny-llama", tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    """Four adapters: all seven projections at two ranks, attention only, and rsLoRA."""
    root = tmp_path_factory.mktemp("adapters")
    kinds: list[dict[str, Any]] = [
        {"rank": 8},
        {"rank": 4, "alpha": 8},
        {"rank": 8, "targets": ["q_proj", "v_proj", "o_proj"]},
        {"rank": 16, "alpha": 16, "use_rslora": True},
    ]
    return [
        LoRARequest(f"a{i}", str(make_adapter(model_dir, root / f"a{i}", seed=i + 1, **kind)))
        for i, kind in enumerate(kinds)
    ]


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.tokenizer.encode(t) for t in TEXTS]


def make_core(loaded: LoadedModel, **overrides: Any) -> EngineCore:
    overrides.setdefault("num_kv_blocks", 96)
    overrides.setdefault("max_model_len", 128)
    overrides.setdefault("max_num_batched_tokens", 128)
    overrides.setdefault("dtype", "float32")
    config = EngineConfig(block_size=4, **overrides)
    return EngineCore(config, ModelRunner(loaded.model, config), eos_token_ids=[])


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def run(core: EngineCore, on_step: Any = None) -> dict[str, list[EngineDelta]]:
    out: dict[str, list[EngineDelta]] = {}
    for _ in range(1000):
        if not core.has_unfinished():
            break
        for delta in core.step():
            out.setdefault(delta.request_id, []).append(delta)
        if on_step is not None:
            on_step(core)
    assert not core.has_unfinished()
    check_all_returned(core.scheduler)
    return out


def tokens(deltas: list[EngineDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def alone(
    loaded: LoadedModel, prompt: list[int], lora: LoRARequest | None, **overrides: Any
) -> list[int]:
    core = make_core(loaded, **overrides)
    core.add_request(EngineRequest("r", prompt, greedy(), lora_request=lora))
    return tokens(run(core)["r"])


def test_greedy_equals_peft_unmerged_and_merged(
    loaded: LoadedModel, model_dir: Path, adapters: list[LoRARequest], prompts: list[list[int]]
) -> None:
    base = alone(loaded, prompts[0], None)
    assert base == peft_greedy(model_dir, None, prompts[0], NEW_TOKENS, merged=False)
    for lora in adapters:
        ours = alone(loaded, prompts[0], lora)
        assert ours != base, f"{lora.name} changes nothing: not a test"
        path = Path(lora.path)
        assert ours == peft_greedy(model_dir, path, prompts[0], NEW_TOKENS, merged=False)
        assert ours == peft_greedy(model_dir, path, prompts[0], NEW_TOKENS, merged=True)


@pytest.mark.parametrize("budget", [128, 5], ids=["whole-prefill", "chunked-prefill"])
def test_one_batch_of_four_adapters_and_the_base_equals_each_alone(
    loaded: LoadedModel, adapters: list[LoRARequest], prompts: list[list[int]], budget: int
) -> None:
    loras: list[LoRARequest | None] = [*adapters, None]
    pairs = list(zip(prompts, loras, strict=True))
    want = {f"r{i}": alone(loaded, p, lora) for i, (p, lora) in enumerate(pairs)}
    core = make_core(loaded, max_num_batched_tokens=budget, max_loras=4)
    for i, (prompt, lora) in enumerate(pairs):
        core.add_request(EngineRequest(f"r{i}", prompt, greedy(), lora_request=lora))
    mixed: list[int] = []

    def adapters_in_step(core: EngineCore) -> None:
        running = core.scheduler.running
        mixed.append(len({r.lora_slot for r in running}))

    got = {rid: tokens(ds) for rid, ds in run(core, adapters_in_step).items()}
    assert got == want
    # whole prompts: four slots and the base in one step; chunks of 5 tokens: fewer
    assert max(mixed) == (5 if budget > 5 else 3)


def test_max_loras_2_evicts_and_loads_adapters_again_on_demand(
    loaded: LoadedModel, adapters: list[LoRARequest], prompts: list[list[int]]
) -> None:
    requests = [(f"r{i}", prompts[i % 4], adapters[i % 4]) for i in range(8)]
    want = {rid: alone(loaded, p, lora) for rid, p, lora in requests}
    core = make_core(loaded, max_loras=2)
    for rid, prompt, lora in requests:
        core.add_request(EngineRequest(rid, prompt, greedy(), lora_request=lora))
    resident: list[int] = []

    def check(core: EngineCore) -> None:
        running = {r.lora_request for r in core.scheduler.running}
        resident.append(len(running))
        assert len(running) <= 2

    got = {rid: tokens(ds) for rid, ds in run(core, check).items()}
    assert got == want
    assert core.scheduler.lora_slots.num_loads >= 4
    # the first adapter was evicted by the last two; a request of it loads it again
    first = adapters[0]
    assert first not in core.scheduler.lora_slots.resident()
    core.add_request(EngineRequest("again", prompts[0], greedy(), lora_request=first))
    assert tokens(run(core)["again"]) == want["r0"]


def test_prefix_cache_is_keyed_by_adapter(
    loaded: LoadedModel, adapters: list[LoRARequest], prompts: list[list[int]]
) -> None:
    core = make_core(loaded)
    prompt = prompts[0]  # 4+ full blocks of 4 tokens
    order: list[tuple[str, LoRARequest | None]] = [
        ("a", adapters[0]),
        ("base", None),
        ("b", adapters[1]),
        ("a-again", adapters[0]),
        ("base-again", None),
    ]
    cached: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    for rid, lora in order:
        core.add_request(EngineRequest(rid, prompt, greedy(), lora_request=lora))
        deltas = run(core)[rid]
        cached[rid] = deltas[-1].num_cached_tokens or 0
        outputs[rid] = tokens(deltas)
    assert cached["a"] == cached["base"] == cached["b"] == 0
    assert cached["a-again"] > 0 and cached["base-again"] > 0
    assert outputs["a-again"] == outputs["a"] and outputs["base-again"] == outputs["base"]
    assert len({tuple(outputs[k]) for k in ("a", "base", "b")}) == 3


def test_an_adapter_that_cannot_load_fails_its_request_alone(
    loaded: LoadedModel,
    model_dir: Path,
    adapters: list[LoRARequest],
    prompts: list[list[int]],
    tmp_path: Path,
) -> None:
    want = alone(loaded, prompts[1], adapters[1])
    core = make_core(loaded)
    with pytest.raises(RequestRejectedError, match="cannot read"):  # no such directory
        core.add_request(
            EngineRequest("missing", prompts[0], greedy(), lora_request=LoRARequest("x", "/nope"))
        )
    # a config that reads but weights that do not fit this model: fails in its first step
    wrong = tmp_path / "wrong"
    make_adapter(model_dir, wrong, seed=9, rank=4)
    config = json.loads((wrong / "adapter_config.json").read_text())
    config["r"] = 8  # the tensors are rank 4
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    core.add_request(
        EngineRequest("bad", prompts[0], greedy(), lora_request=LoRARequest("w", str(wrong)))
    )
    core.add_request(EngineRequest("good", prompts[1], greedy(), lora_request=adapters[1]))
    core.add_request(EngineRequest("base", prompts[2], greedy()))
    out = run(core)
    assert out["bad"][-1].finish_reason == "error" and "shapes" in (out["bad"][-1].error or "")
    assert tokens(out["bad"]) == []
    assert tokens(out["good"]) == want and out["good"][-1].finish_reason == "length"
    assert tokens(out["base"]) == alone(loaded, prompts[2], None)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
        ({"target_modules": "all-linear"}, "target_modules"),
        ({"r": 128}, "max_lora_rank=64"),
        ({"peft_type": "IA3"}, "IA3"),
    ],
)
def test_unsupported_adapter_configs_are_refused_by_name(
    adapters: list[LoRARequest], tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    source = Path(adapters[0].path)
    config = json.loads((source / "adapter_config.json").read_text()) | change
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(LoRAAdapterError, match=match):
        read_lora_config(LoRARequest("x", str(tmp_path)), max_rank=64)


def test_an_engine_with_max_loras_0_refuses_adapters(
    loaded: LoadedModel, adapters: list[LoRARequest], prompts: list[list[int]]
) -> None:
    core = make_core(loaded, max_loras=0)
    with pytest.raises(RequestRejectedError, match="max_loras=0"):
        core.add_request(EngineRequest("r", prompts[0], greedy(), lora_request=adapters[0]))


def test_bf16_prompt_logprobs_with_an_adapter_track_peft(
    model_dir: Path, adapters: list[LoRARequest], prompts: list[list[int]]
) -> None:
    """bf16 (the CPU kernels' path where the host has them): an adapter's prompt logprobs
    stay as close to fp32 HF + PEFT as the base model's do to HF, and the adapter moves
    them by far more than that."""
    import peft
    import transformers

    lm = load_model(model_dir, dtype="bfloat16")
    core = make_core(lm, dtype="bfloat16")
    prompt = prompts[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    lora = adapters[0]

    def ours(adapter: LoRARequest | None) -> torch.Tensor:
        core.add_request(EngineRequest(f"p-{adapter}", prompt, params, lora_request=adapter))
        entries = run(core)[f"p-{adapter}"][0].prompt_logprobs or []
        return torch.tensor([e.logprob for e in entries if e is not None])

    def reference(adapter: LoRARequest | None) -> torch.Tensor:
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, adapter.path)
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)

    base_error = (ours(None) - reference(None)).abs().max().item()
    lora_error = (ours(lora) - reference(lora)).abs().max().item()
    effect = (reference(lora) - reference(None)).abs().max().item()
    assert lora_error <= 2 * base_error + 0.01
    assert effect > 10 * lora_error
