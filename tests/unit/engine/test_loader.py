"""Loading: the tiny-llama preset, clear errors for bad directories, generation defaults."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from sluice.engine.loader import ModelLoadError, load_model, resolve_model_dir


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model_dir("tiny-llama", tmp_path_factory.mktemp("data"))


def test_preset_is_a_standard_hf_directory(preset: Path) -> None:
    names = {p.name for p in preset.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= names


def test_preset_is_deterministic_and_created_once(preset: Path, tmp_path: Path) -> None:
    again = resolve_model_dir("tiny-llama", tmp_path)
    assert _digest(again) == _digest(preset)
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir("tiny-llama", tmp_path) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_preset_loads_with_tokenizer_and_eos(preset: Path) -> None:
    lm = load_model(preset, dtype="bfloat16")
    assert lm.eos_token_ids == (1, 3)
    assert lm.generation.max_new_tokens == 256
    assert lm.tokenizer.decode(lm.tokenizer.encode("hello sluice")) == "hello sluice"
    assert lm.model.embed_tokens.weight.dtype.is_floating_point
    assert str(lm.model.embed_tokens.weight.dtype) == "torch.bfloat16"


def test_config_overrides_get_their_own_directory(tmp_path: Path) -> None:
    path = resolve_model_dir("tiny-llama", tmp_path, {"num_hidden_layers": 1})
    assert path.name.startswith("tiny-llama-")
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 1


def test_missing_files_are_named_in_one_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path / "m")
    msg = str(err.value)
    assert "config.json" in msg and "tokenizer.json" in msg and "safetensors" in msg


def test_missing_shard_and_unsupported_model(preset: Path, tmp_path: Path) -> None:
    broken = shutil.copytree(preset, tmp_path / "b")
    (broken / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match="model-00001-of-00002"):
        load_model(broken)
    (broken / "model.safetensors.index.json").unlink()
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model(broken)


def test_missing_tensors_are_named(preset: Path, tmp_path: Path) -> None:
    broken = shutil.copytree(preset, tmp_path / "c")
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 6}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.4\."):
        load_model(broken)
