"""Settings validation messages and the CLI commands that exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from sluice import __version__
from sluice.cli import app
from sluice.settings import Settings, SettingsError, load_settings

runner = CliRunner()


def test_settings_read_the_sluice_prefix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", "127.0.0.1:9092,127.0.0.2:9093")
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_DATABASE_URL", "postgresql+psycopg://u@h:5432/db")
    settings = load_settings()
    assert settings.kafka_bootstrap == "127.0.0.1:9092,127.0.0.2:9093"
    assert settings.data_dir == tmp_path
    assert load_settings(Settings, kafka_bootstrap="h:1").kafka_bootstrap == "h:1"


def test_the_kafka_fetch_wait_reaches_every_consumer_of_the_bus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SLUICE_KAFKA_FETCH_MAX_WAIT_MS sets the bus's fetch wait (a Kafka deployment raises
    it; docs/operations.md), which consumers without their own wait use."""
    from sluice import wiring
    from sluice.bus.kafka import KafkaEventBus

    seen: dict[str, int] = {}

    class Recording(KafkaEventBus):
        def __init__(self, config: object) -> None:
            seen["wait"] = config.fetch_max_wait_ms  # type: ignore[attr-defined]

        def create_topics(self, specs: object) -> None:
            pass

    monkeypatch.setattr(wiring, "KafkaEventBus", Recording)
    monkeypatch.setenv("SLUICE_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    monkeypatch.setenv("SLUICE_KAFKA_FETCH_MAX_WAIT_MS", "250")
    wiring.make_bus(load_settings(), "test")
    assert seen == {"wait": 250}
    monkeypatch.delenv("SLUICE_KAFKA_FETCH_MAX_WAIT_MS")
    wiring.make_bus(load_settings(), "test")
    assert seen == {"wait": 5}


@pytest.mark.parametrize(
    ("var", "value", "fix"),
    [
        ("SLUICE_KAFKA_BOOTSTRAP", "localhost", "host:port"),
        ("SLUICE_KAFKA_BOOTSTRAP", "h:99999", "host:port"),
        ("SLUICE_REDIS_URL", "http://x", "redis://127.0.0.1:6379/0"),
        ("SLUICE_DATABASE_URL", "mysql://x", "postgresql+psycopg://"),
        ("SLUICE_LOG_LEVEL", "LOUD", "DEBUG, INFO"),
        ("SLUICE_REQUEST_PARTITIONS", "0", "greater than or equal to 1"),
        ("SLUICE_TORCH_THREADS", "0", "greater than or equal to 1"),
        ("SLUICE_DTYPE", "int4", "'auto', 'float32', 'bfloat16' or 'float16'"),
    ],
)
def test_bad_values_name_the_variable_the_value_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, fix: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert f"{var}={value!r}" in message
    assert fix in message


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"sluice {__version__}"


def test_bad_configuration_exits_2_with_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_REDIS_URL", "nope://")
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 2
    assert "SLUICE_REDIS_URL='nope://' is invalid" in result.output


def test_doctor_reports_one_line_per_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    monkeypatch.delenv("SLUICE_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.delenv("SLUICE_DATABASE_URL", raising=False)
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is False
    assert checks["redis"]["ok"] is False and "SLUICE_REDIS_URL" in checks["redis"]["fix"]
    assert checks["data dir"]["ok"] and checks["kafka"]["ok"] and checks["database"]["ok"]


def test_unbuilt_commands_do_not_appear() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ("doctor", "bench"):
        assert name in result.output


def test_torch_threads_leave_a_core_on_cpu_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from sluice.settings import ModelSettings
    from sluice.wiring import resolve_torch_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert resolve_torch_threads(load_settings(ModelSettings), "cpu") == 3
    assert resolve_torch_threads(load_settings(ModelSettings), "cuda") is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert resolve_torch_threads(load_settings(ModelSettings), "cpu") == 1
    monkeypatch.setenv("SLUICE_TORCH_THREADS", "2")
    assert resolve_torch_threads(load_settings(ModelSettings), "cpu") == 2


def test_prefill_threads_take_every_core_unless_the_engines_threads_are_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from sluice.settings import ModelSettings
    from sluice.wiring import resolve_prefill_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert resolve_prefill_threads(load_settings(ModelSettings), "cpu") == 4
    assert resolve_prefill_threads(load_settings(ModelSettings), "cuda") is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert resolve_prefill_threads(load_settings(ModelSettings), "cpu") is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    for var, value in [("SLUICE_TORCH_THREADS", "1"), ("SLUICE_ENGINE_CPUS", "auto")]:
        monkeypatch.setenv(var, value)
        assert resolve_prefill_threads(load_settings(ModelSettings), "cpu") is None
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLUICE_PREFILL_THREADS", "3")
    monkeypatch.setenv("SLUICE_TORCH_THREADS", "1")
    assert resolve_prefill_threads(load_settings(ModelSettings), "cpu") == 3


def test_engine_replicas_are_two_on_a_cpu_host_unless_its_engine_is_sized(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import os

    from sluice.settings import ModelSettings
    from sluice.wiring import resolve_engine_replicas

    def replicas(device: str = "cpu", **overrides: object) -> int:
        return resolve_engine_replicas(load_settings(ModelSettings, **overrides), device)

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert replicas() == 2
    assert replicas("cuda") == 1
    assert replicas(engine_process=False) == 1  # one engine thread in the serving process
    assert replicas(backend="sim") == 1
    chosen = [("SLUICE_TORCH_THREADS", "1"), ("SLUICE_PREFILL_THREADS", "2")]
    for var, value in [*chosen, ("SLUICE_ENGINE_CPUS", "auto")]:
        monkeypatch.setenv(var, value)
        assert replicas() == 1
        monkeypatch.delenv(var)
    # a checkpoint whose two copies would take much of the host's memory: one engine
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(memory // 8)  # sparse: no disk used
    assert replicas(model=str(tmp_path)) == 1
    (tmp_path / "model.safetensors").unlink()
    assert replicas(model=str(tmp_path)) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert replicas() == 1
    monkeypatch.setenv("SLUICE_ENGINE_REPLICAS", "3")
    assert replicas() == 3


def test_sluice_up_gives_several_engine_workers_one_engine_each_unless_told() -> None:
    from sluice.up import engine_worker_env

    assert engine_worker_env(1, {}) == {}
    assert engine_worker_env(2, {}) == {"SLUICE_ENGINE_REPLICAS": "1"}
    assert engine_worker_env(2, {"SLUICE_ENGINE_REPLICAS": "2"}) == {}


def test_engine_cpus_take_auto_or_a_cpu_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.settings import ModelSettings

    assert load_settings(ModelSettings).engine_cpus is None
    for good in ("auto", "1-3", "0,2-3"):
        monkeypatch.setenv("SLUICE_ENGINE_CPUS", good)
        assert load_settings(ModelSettings).engine_cpus == good
    monkeypatch.setenv("SLUICE_ENGINE_CPUS", "cores 1 to 3")
    with pytest.raises(SettingsError, match="SLUICE_ENGINE_CPUS"):
        load_settings(ModelSettings)


def test_engine_options_default_to_the_engines_own_and_read_their_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import os

    from sluice.engine.options import EngineOptions
    from sluice.settings import ModelSettings
    from sluice.wiring import engine_options

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    cpu = {"device": "cpu"}
    # two engine processes (`resolve_engine_replicas`) sharing all cores but one
    assert engine_options(load_settings(ModelSettings, **cpu)) == EngineOptions(torch_threads=1)
    monkeypatch.setenv("SLUICE_ENGINE_REPLICAS", "1")
    assert engine_options(load_settings(ModelSettings, **cpu)) == EngineOptions(
        torch_threads=3, prefill_threads=4
    )
    for var, value in [
        ("SLUICE_ENGINE_KERNELS", "0"),
        ("SLUICE_KERNEL_CACHE", str(tmp_path)),
        ("SLUICE_KERNEL_PARALLEL_MIN", "1024"),
        ("SLUICE_ENGINE_PREPACK", "0"),
        ("SLUICE_ENGINE_CPU_UPCAST", "0"),
        ("SLUICE_ENGINE_THREAD_NICE", "none"),
        ("SLUICE_GIL_SWITCH_INTERVAL_S", "0.001"),
        ("SLUICE_ENGINE_CPUS", "3"),
        ("SLUICE_PREFILL_THREADS", "2"),
        ("SLUICE_PREFILL_MIN_TOKENS", "64"),
    ]:
        monkeypatch.setenv(var, value)
    assert engine_options(load_settings(ModelSettings, **cpu)) == EngineOptions(
        kernels=False,
        kernel_cache_dir=tmp_path,
        kernel_parallel_min_work=1024,
        prepack=False,
        cpu_upcast=False,
        torch_threads=3,
        prefill_threads=2,
        prefill_min_tokens=64,
        thread_nice=None,
        cpus=frozenset({3}),
        gil_switch_interval_s=0.001,
    )
    monkeypatch.setenv("SLUICE_ENGINE_THREAD_NICE", "40")
    with pytest.raises(SettingsError, match="SLUICE_ENGINE_THREAD_NICE"):
        load_settings(ModelSettings)


def _sluice(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m sluice ARGS`, the entry point a user runs."""
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_store_commands_take_data_dir_as_the_variable_does(tmp_path: Path) -> None:
    home, data = tmp_path / "home", tmp_path / "data"
    home.mkdir()
    # HOME decides the default ~/.sluice, read when the settings module is imported
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["HOME"] = str(home)
    created = _sluice("tenants", "create", "acme", "--data-dir", str(data), "--json", env=env)
    assert created.returncode == 0, created.stderr
    listed = _sluice("tenants", "list", "--data-dir", str(data), "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert [t["name"] for t in json.loads(listed.stdout)] == ["acme"]
    by_variable = _sluice("tenants", "list", "--json", env={**env, "SLUICE_DATA_DIR": str(data)})
    assert [t["name"] for t in json.loads(by_variable.stdout)] == ["acme"]
    assert (data / "sluice.db").is_file()
    assert not (home / ".sluice").exists()


def test_a_bad_flag_names_the_flag_and_a_bad_variable_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = runner.invoke(app, ["serve", "--port", "99999"])
    assert result.exit_code == 2
    assert "--port 99999 is invalid: Input should be less than or equal to 65535" in result.output
    assert "SLUICE_PORT" not in result.output
    monkeypatch.setenv("SLUICE_PORT", "99999")
    result = runner.invoke(app, ["gateway"])
    assert result.exit_code == 2
    assert "SLUICE_PORT='99999' is invalid" in result.output


def test_help_shows_defaults_and_h_is_help() -> None:
    for command in (["serve"], ["tenants", "create"]):
        short = runner.invoke(app, [*command, "-h"], env={"COLUMNS": "80"})
        assert short.exit_code == 0, short.output
        assert short.output.startswith(f"Usage: sluice {' '.join(command)} [OPTIONS]")
        assert (
            short.output == runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"}).output
        )
    wide = {"COLUMNS": "200"}  # one line per option: no wrap inside a default
    serve = runner.invoke(app, ["serve", "-h"], env=wide).output
    assert "[default: (8000)]" in serve and "[default: (127.0.0.1)]" in serve
    assert "[default: (~/.sluice)]" in serve
    tenants = runner.invoke(app, ["tenants", "create", "-h"], env=wide).output
    assert "[default: (no limit); x>=0]" in tenants


def _commands(
    command: click.Command, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], click.Command]]:
    if isinstance(command, click.Group):
        out = [(path, command)]
        for name, sub in command.commands.items():
            out += _commands(sub, (*path, name))
        return out
    return [(path, command)]


@pytest.mark.parametrize("columns", ["60", "80", "100"])
def test_help_keeps_every_option_name_whole_and_no_stray_spaces(columns: str) -> None:
    for path, command in _commands(typer.main.get_command(app)):
        result = runner.invoke(app, [*path, "-h"], env={"COLUMNS": columns})
        assert result.exit_code == 0, (path, result.output)
        for param in command.params:
            for name in (*param.opts, *param.secondary_opts):
                if name.startswith("-"):
                    assert name in result.output, (path, name, result.output)
        for stray in (" .", " ,", " ;", " :"):
            assert stray not in result.output, (path, stray, result.output)


def test_prices_list_says_when_it_is_empty_and_shows_the_discount_in_percent(
    tmp_path: Path,
) -> None:
    data = ["--data-dir", str(tmp_path)]
    empty = runner.invoke(app, ["prices", "list", *data])
    assert empty.exit_code == 0, empty.output
    assert empty.output.startswith("no prices set") and "sluice prices set" in empty.output
    price = ["--input", "0.15", "--cached-input", "0.075", "--output", "0.6"]
    result = runner.invoke(app, ["prices", "set", "m", *price, "--batch-discount", "0.5", *data])
    assert result.exit_code == 0, result.output
    assert "batch discount 50%" in result.output
    runner.invoke(app, ["prices", "set", "n", *price, "--batch-discount", "0.125", *data])
    lines = runner.invoke(app, ["prices", "list", *data]).output.splitlines()
    assert [line.split()[0] for line in lines] == ["m", "n"]
    assert lines[0].endswith("batch    50% off") and lines[1].endswith("batch  12.5% off")


def test_doctor_reports_a_missing_data_dir_and_leaves_it_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("SLUICE_REDIS_URL", "SLUICE_KAFKA_BOOTSTRAP", "SLUICE_DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)
    missing = tmp_path / "not" / "here"
    result = runner.invoke(app, ["doctor", "--json", "--data-dir", str(missing)])
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert checks["data dir"]["detail"] == f"{missing} does not exist yet (created on first use)"
    assert not (tmp_path / "not").exists()


def test_every_backend_tokenizes_the_default_gguf_as_the_gateway_does(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upstream backend (and the sim's) reads the GGUF's own tokenizer, the one the
    gateway tokenizes with: token ids cross the wire, so they must agree."""
    from sluice.wiring import build_sim_backend, build_upstream_backend, served_model

    monkeypatch.setenv("SLUICE_MODEL", str(gguf))
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_UPSTREAM_URLS", "http://127.0.0.1:9")
    settings = load_settings(Settings)
    gateway = served_model(settings).tokenizer
    text = "<|im_start|>user\nQuelle est la capitale de la France ? 日本<|im_end|>"
    want = gateway.encode(text, add_special_tokens=False)
    for backend in (build_upstream_backend(settings), build_sim_backend(settings)):
        assert backend.tokenizer.encode(text, add_special_tokens=False) == want
        assert backend.max_model_len == served_model(settings).max_model_len


def test_the_sim_backend_takes_its_minimum_step_from_the_settings(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluice.wiring import build_sim_backend

    monkeypatch.setenv("SLUICE_MODEL", str(gguf))
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    assert build_sim_backend(load_settings(Settings)).preset.min_step_ms == 0.0
    monkeypatch.setenv("SLUICE_SIM_MIN_STEP_MS", "50")
    backend = build_sim_backend(load_settings(Settings))
    assert backend.preset.min_step_ms == 50.0
    assert backend.preset.step_time_s(1, 1, 1, 0) == pytest.approx(0.050)
