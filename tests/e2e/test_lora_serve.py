"""LoRA adapters end to end in `sluice serve` (the torch engine in its own process): an
adapter from `--lora` and a private one loaded at run time through the admin API, each
answering with HF + PEFT's greedy tokens for it, beside the base's; tenant B can neither
list nor use tenant A's private adapter (404 model_not_found), and after an unload
nobody can."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sluice.engine.preset import ensure_tiny_llama
from tests.e2e.procs import API_KEY, SluiceProcess, free_port, serving_args, wait_ready
from tests.unit.engine.lora_adapters import make_adapter, peft_greedy

pytestmark = pytest.mark.slow

ADMIN_KEY = "sk-e2e-admin"
PROMPT = [5, 17, 42, 99, 7, 64, 3, 200]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def own_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Not the session's shared data dir: the tenants this test creates would leave every
    later `serve` on it accepting tenant keys only."""
    return tmp_path_factory.mktemp("lora-data")


@pytest.fixture(scope="module")
def adapters(own_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("peft")
    model = ensure_tiny_llama(own_data_dir)
    root = tmp_path_factory.mktemp("adapters")
    return {
        "model": model,
        "sql": make_adapter(model, root / "sql", seed=1),
        "poet": make_adapter(model, root / "poet", seed=2, rank=4),
    }


@pytest.fixture(scope="module")
def base_url(
    own_data_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    port = free_port()
    args = [*serving_args("serve", port, own_data_dir), "--model", "tiny-llama"]
    args += ["--lora", f"sql={adapters['sql']}"]
    log = tmp_path_factory.mktemp("lora") / "serve.log"
    proc = SluiceProcess(args, log, {"SLUICE_ADMIN_KEY": ADMIN_KEY}).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]


def _greedy(client: openai.OpenAI, model: str) -> list[int]:
    reply = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    return list(reply.choices[0].token_ids)  # type: ignore[attr-defined]


def _admin(base: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.request(method, f"{base}{path}", json=body, headers=headers, timeout=30)


def test_adapters_answer_as_hf_peft_and_a_private_one_is_its_tenants_alone(
    base_url: str, adapters: dict[str, Path]
) -> None:
    model = adapters["model"]
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as client:
        listed = {m.id: m for m in client.models.list().data}
        assert listed["sql"].parent == "tiny-llama"  # type: ignore[attr-defined]
        assert _greedy(client, "sql") == peft_greedy(
            model, adapters["sql"], PROMPT, NEW_TOKENS, merged=False
        )
        assert _greedy(client, "tiny-llama") == peft_greedy(
            model, None, PROMPT, NEW_TOKENS, merged=False
        )
    keys = {}
    for name in ("acme", "globex"):
        created = _admin(base_url, "POST", "/admin/v1/tenants", {"name": name})
        assert created.status_code == 201, created.text
        keys[name] = (created.json()["tenant_id"], created.json()["api_key"])
    loaded = _admin(
        base_url,
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "poet", "lora_path": str(adapters["poet"]), "tenant_id": keys["acme"][0]},
    )
    assert loaded.status_code == 200, loaded.text
    acme = openai.OpenAI(base_url=f"{base_url}/v1", api_key=keys["acme"][1], max_retries=0)
    globex = openai.OpenAI(base_url=f"{base_url}/v1", api_key=keys["globex"][1], max_retries=0)
    with acme, globex:
        assert "poet" in {m.id for m in acme.models.list().data}
        assert _greedy(acme, "poet") == peft_greedy(
            model, adapters["poet"], PROMPT, NEW_TOKENS, merged=True
        )
        assert "poet" not in {m.id for m in globex.models.list().data}
        with pytest.raises(openai.NotFoundError) as hidden:
            _greedy(globex, "poet")
        assert hidden.value.code == "model_not_found"
        assert _greedy(globex, "sql") == _greedy(acme, "sql")  # public: both may use it
        unloaded = _admin(base_url, "POST", "/v1/unload_lora_adapter", {"lora_name": "poet"})
        assert unloaded.status_code == 200, unloaded.text
        with pytest.raises(openai.NotFoundError):
            _greedy(acme, "poet")
