"""The engine's real tokenizer (tiny-llama preset) plugs into the gateway as `Tokenizer`.

This is what the composition root does: `ServedModel(tokenizer=engine.tokenizer.Tokenizer)`;
the chat template renders at the gateway and the token ids reach the engine.
"""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from sluice.api.app import create_app
from sluice.api.served import ServedModel
from sluice.bus.memory import MemoryEventBus
from sluice.engine.preset import ensure_tiny_llama
from sluice.engine.tokenizer import Tokenizer
from tests.unit.api.conftest import API_KEY, gateway_settings
from tests.unit.api.fakes import FakeEngineWorker


def test_chat_with_the_engine_tokenizer(tmp_path: Path, memory_bus: MemoryEventBus) -> None:
    tokenizer = Tokenizer.from_dir(ensure_tiny_llama(tmp_path))
    model = ServedModel(name="tiny-llama", max_model_len=512, tokenizer=tokenizer)
    app = create_app(gateway_settings(), memory_bus, [model])
    messages = [{"role": "user", "content": "hi there"}]
    engine = FakeEngineWorker(memory_bus, pools=("tiny-llama",)).start()  # the model's pool
    try:
        with TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            body = {"model": "tiny-llama", "messages": messages}
            r = client.post("/v1/chat/completions", json=body)
    finally:
        engine.stop()
    assert r.status_code == 200, r.text
    [(_, req)] = engine.requests
    assert req.prompt_token_ids == tokenizer.apply_chat_template(messages, tokenize=True)
    assert r.json()["usage"]["prompt_tokens"] == len(req.prompt_token_ids)


def test_long_texts_tokenize_the_same_without_the_gil(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(ensure_tiny_llama(tmp_path))
    text = "Once upon a time, héllo wörld! " * 400  # past the GIL-free threshold
    raw = tokenizer._tok  # the HF tokenizer underneath, encoded the plain way
    assert tokenizer.encode(text) == raw.encode(text).ids
    assert (
        tokenizer.encode(text, add_special_tokens=False)
        == raw.encode(text, add_special_tokens=False).ids
    )
    # no token covers more characters than its vocabulary entry has
    assert max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size)) <= (
        tokenizer.max_token_chars
    )
