"""`sluice up` with model pools: engine workers per served model, named by pool when there
are several, readiness awaited per pool, `--pool MODEL=N` sizes (0: none started);
`serve` announces once every model's engine is ready."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

import sluice.up
from sluice import wiring
from sluice.bus.topics import Lane, request_topic
from sluice.cli import app as cli_app
from sluice.cli_serving import _announce, _report_startup
from sluice.settings import GatewaySettings
from sluice.up import ENGINE, GATEWAY, Child, EnginePool, readiness_urls, run_up

runner = CliRunner()


def _engine(name: str, pool: str, port: int) -> Child:
    return Child(name, ["sluice"], {"SLUICE_METRICS_PORT": str(port)}, ENGINE, pool=pool)


def test_readiness_waits_for_one_engine_worker_of_each_pool() -> None:
    children = [
        Child("gateway", ["sluice"], stage=GATEWAY),
        _engine("engine-worker-a-0", "a", 9101),
        _engine("engine-worker-a-1", "a", 9102),
        _engine("engine-worker-b-0", "b", 9103),
        Child("billing", ["sluice"]),
    ]
    assert readiness_urls(children, "127.0.0.1:8000") == [
        ["http://127.0.0.1:8000/readyz"],
        ["http://127.0.0.1:9101/readyz", "http://127.0.0.1:9102/readyz"],
        ["http://127.0.0.1:9103/readyz"],
    ]
    # a pool with no worker started here (0) is not waited for: its requests wait
    gateway_only = [children[0], children[4]]
    assert readiness_urls(gateway_only, "127.0.0.1:8000") == [["http://127.0.0.1:8000/readyz"]]


class _Recorded(Exception):
    pass


def _children_of(monkeypatch: pytest.MonkeyPatch, pools: Sequence[EnginePool]) -> list[Child]:
    """The children `run_up` would supervise (stopped before any starts)."""
    seen: list[Child] = []

    def supervisor(children: list[Child], env: dict[str, str], restart: bool = True) -> Any:
        seen.extend(children)
        raise _Recorded

    monkeypatch.setattr(sluice.up, "Supervisor", supervisor)
    monkeypatch.delenv("SLUICE_ENGINE_REPLICAS", raising=False)
    with pytest.raises(_Recorded):
        run_up(["--no-announce"], pools, "127.0.0.1:1")
    return seen


def test_one_pools_workers_keep_their_plain_names(monkeypatch: pytest.MonkeyPatch) -> None:
    children = _children_of(monkeypatch, [EnginePool("tiny-llama", ["--model", "x"], 2)])
    engines = [c for c in children if c.stage == ENGINE]
    assert [c.name for c in engines] == ["engine-worker-0", "engine-worker-1"]
    assert {c.pool for c in engines} == {"tiny-llama"}
    assert all(c.argv[-2:] == ["--model", "x"] for c in engines)
    assert all(c.env == {"SLUICE_ENGINE_REPLICAS": "1"} for c in engines)  # one engine each


def test_several_pools_name_their_workers_by_pool_and_zero_starts_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pools = [
        EnginePool("a", ["--model", "a"], 1),
        EnginePool("b", ["--model", "b"], 2),
        EnginePool("c", ["--model", "c"], 0),
    ]
    engines = [c for c in _children_of(monkeypatch, pools) if c.stage == ENGINE]
    assert [(c.name, c.pool) for c in engines] == [
        ("engine-worker-a-0", "a"),
        ("engine-worker-b-0", "b"),
        ("engine-worker-b-1", "b"),
    ]
    assert [c.argv[-1] for c in engines] == ["a", "b", "b"]


def _up_pools(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[list[EnginePool], Any]:
    started: list[tuple[Sequence[str], Sequence[EnginePool]]] = []

    def record(gateway_args: Sequence[str], pools: Sequence[EnginePool], *a: Any, **k: Any) -> int:
        started.append((gateway_args, pools))
        return 0

    monkeypatch.setattr(sluice.up, "run_up", record)
    result = runner.invoke(cli_app, ["up", "--api-key", "sk-up-pools", *args])
    return ([*started[0][1]] if started else []), result


def test_up_runs_a_pool_per_model_sized_by_pool_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    pools, result = _up_pools(
        monkeypatch,
        *("--model", "tiny-llama", "--model", "smollm2-135m-instruct"),
        *("--engine-workers", "2", "--pool", "smollm2-135m-instruct=0"),
    )
    assert result.exit_code == 0, result.output
    assert [(p.name, p.workers) for p in pools] == [
        ("tiny-llama", 2),
        ("smollm2-135m-instruct", 0),
    ]
    assert [p.args[p.args.index("--model") + 1] for p in pools] == [
        "tiny-llama",
        "smollm2-135m-instruct",
    ]


@pytest.mark.parametrize("bad", ["unknown-model=1", "tiny-llama", "tiny-llama=many"])
def test_up_refuses_a_pool_flag_it_cannot_read(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    pools, result = _up_pools(monkeypatch, "--model", "tiny-llama", "--pool", bad)
    assert result.exit_code == 2 and "MODEL=N" in result.output
    assert pools == []


def test_the_topic_layout_has_the_lanes_of_every_served_models_pool() -> None:
    settings = GatewaySettings(model="tiny-llama", models="smollm2-135m-instruct")  # type: ignore[call-arg]
    assert [s.model_name for s in wiring.each_model(settings)] == [
        "tiny-llama",
        "smollm2-135m-instruct",
    ]
    names = {spec.name for spec in wiring.topic_layout(settings).specs()}
    for pool in ("tiny-llama", "smollm2-135m-instruct"):
        for lane in Lane:
            assert request_topic(lane, pool) in names
            assert f"{request_topic(lane, pool)}.dlq" in names


class _Worker:
    def __init__(self, healthy: bool = True) -> None:
        self.healthy = healthy

    def health(self) -> bool:
        return self.healthy


def _serving_app(ready: bool) -> Any:
    probe = SimpleNamespace(unavailable=lambda: None, ready=lambda: ready)
    return SimpleNamespace(
        state=SimpleNamespace(worker_probe=probe, gateway=SimpleNamespace(service=READY))
    )


READY = SimpleNamespace(ready=True)


def test_serve_announces_once_the_engines_of_every_model_are_ready(
    capsys: pytest.CaptureFixture[str],
) -> None:
    announced: list[bool] = []
    server = SimpleNamespace(started=True)
    backends = [SimpleNamespace(pid=11), SimpleNamespace(pids=[12, 13])]
    workers = [_Worker(), _Worker()]
    _report_startup(server, _serving_app(True), workers, backends, lambda: announced.append(True))
    assert announced == [True]
    err = capsys.readouterr().err
    assert "engine process pid=11,12,13 started" in err and "engines ready after" in err


def test_serve_says_so_and_never_announces_when_one_models_worker_stops(
    capsys: pytest.CaptureFixture[str],
) -> None:
    announced: list[bool] = []
    workers = [_Worker(), _Worker(healthy=False)]
    backends = [SimpleNamespace(pid=None), SimpleNamespace(pid=None)]
    server = SimpleNamespace(started=True)
    _report_startup(server, _serving_app(False), workers, backends, lambda: announced.append(True))
    assert announced == []
    assert "an engine worker stopped before it was ready" in capsys.readouterr().err


def test_the_announcement_names_every_served_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    settings = GatewaySettings(  # type: ignore[call-arg]
        model="tiny-llama",
        models="smollm2-135m-instruct",
        port=8123,
        data_dir=tmp_path,
        api_keys=["sk-announced"],
    )
    _announce(settings, "'tiny-llama', 'smollm2-135m-instruct'", "gateway")
    out = capsys.readouterr().out
    assert "serving 'tiny-llama', 'smollm2-135m-instruct' at http://" in out
    assert ":8123/v1" in out
