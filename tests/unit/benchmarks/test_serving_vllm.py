"""`benchmarks.serving_vllm` without vLLM: the model copy, the workload, the skip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from benchmarks import serving_vllm


def _model(path: Path) -> Path:
    path.mkdir()
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_the_copy_names_every_id_and_links_the_weights(tmp_path: Path) -> None:
    src = _model(tmp_path / "src")
    dst = serving_vllm.full_vocab_dir(src, tmp_path / "dst")
    tokenizer = tokenizers.Tokenizer.from_file(str(dst / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 10
    assert tokenizer.decode([2, 3]) == "ab"  # its own tokens as they were
    assert tokenizer.decode([4, 9]) == " w4 w9"  # every other id a word of its own
    assert (dst / "model.safetensors").resolve() == (src / "model.safetensors").resolve()
    assert json.loads((dst / "config.json").read_text()) == {"vocab_size": 10}
    # a second call over the same directory changes nothing
    serving_vllm.full_vocab_dir(src, dst)
    assert tokenizers.Tokenizer.from_file(str(dst / "tokenizer.json")).get_vocab_size() == 10


def test_the_workload_is_seeded_and_exact() -> None:
    a = serving_vllm.bodies(5, 40, 30, vocab=100, seed=3)
    assert a == serving_vllm.bodies(5, 40, 30, vocab=100, seed=3)
    assert a != serving_vllm.bodies(5, 40, 30, vocab=100, seed=4)
    for body in a:
        assert 16 <= len(body["prompt"]) <= 40
        assert all(4 <= t < 100 for t in body["prompt"])
        assert 16 <= body["max_tokens"] <= 30
        assert body["ignore_eos"] and body["stream"] and body["temperature"] == 0
    fixed = serving_vllm.bodies(3, 40, 30, vocab=100, seed=3, fixed_output=7)
    assert [b["max_tokens"] for b in fixed] == [7, 7, 7]


def test_without_the_peer_the_run_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving_vllm, "PEER_PYTHON", tmp_path / "missing" / "python")
    result = serving_vllm.run(quick=True, data_dir=str(tmp_path))
    assert result["skipped"] == {"vllm": "run scripts/peers vllm"}
    assert "scripts/peers vllm" in serving_vllm.render(result)


def test_each_arm_gets_its_command_and_only_its_settings(tmp_path: Path) -> None:
    peer = serving_vllm.PeerSettings(threads_bind="0-1")
    arms = serving_vllm.launches(tmp_path / "m", tmp_path, peer)
    sluice, vllm = arms["sluice"], arms["vllm"]
    assert sluice.cmd[1:4] == ["-m", "sluice", "serve"] and sluice.ready_path == "/readyz"
    assert sluice.cmd[sluice.cmd.index("--port") + 1] == str(sluice.port)
    assert "vllm.entrypoints.openai.api_server" in vllm.cmd and vllm.ready_path == "/health"
    assert vllm.cmd[vllm.cmd.index("--port") + 1] == str(vllm.port) != str(sluice.port)
    assert vllm.cmd[vllm.cmd.index("--max-num-seqs") + 1] == "64"
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert not any(k.startswith("VLLM_") for k in sluice.env)
