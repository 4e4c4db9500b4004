"""docker-compose.yml: valid Compose, real commands and settings, a sound start order.

Docker does not run here: the file is checked against the Compose Specification's JSON
schema (deploy/schemas/compose-spec.json), each Sluice container's command line against
the `sluice` CLI, and each SLUICE_* variable against the settings of the process it
configures.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from sluice.settings import EngineWorkerSettings, GatewaySettings
from sluice.up import ENGINE_STOP_AFTER_DRAIN_S
from tests.unit.deploy.sluice_checks import (
    ROOT,
    SCHEMAS,
    check_settings_env,
    dockerfile_entrypoint,
    dockerfile_env,
    errors,
    parse_command,
    settings_fields,
    validator,
)

COMPOSE = ROOT / "docker-compose.yml"
SLUICE_IMAGE = "${SLUICE_IMAGE:-sluice:local}"
WORKER_METRICS_PORT = "9400"
# `${VAR:-default}`, `${VAR-default}`, `${VAR:?message}`, `${VAR}` (Compose interpolation)
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*)|(:?\?)([^}]*))?\}")


def _interpolate(value: str) -> str:
    """As `docker compose` would with none of the variables set (a required one: a
    stand-in value)."""
    return _VAR.sub(lambda m: m.group(3) if m.group(2) else ("x" if m.group(4) else ""), value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def _sluice_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if s.get("image") == SLUICE_IMAGE}


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "environment as a mapping"
    return {k: _interpolate(str(v)) for k, v in env.items()}


def test_compose_file_follows_the_compose_specification(compose: dict[str, Any]) -> None:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    assert list(errors(validator(schema), compose)) == []


def test_the_schema_rejects_what_compose_rejects(compose: dict[str, Any]) -> None:
    """The schema is not vacuous: a misspelt key and a bad condition fail."""
    validate = validator(json.loads((SCHEMAS / "compose-spec.json").read_text()))
    broken = json.loads(json.dumps(compose))
    broken["services"]["gateway"]["depends_on"]["kafka"]["condition"] = "service_up"
    broken["services"]["engine"]["stop_grace_periods"] = "45s"
    found = "\n".join(errors(validate, broken))
    assert "service_up" in found and "stop_grace_periods" in found


def test_every_sluice_command_is_a_real_cli_command(compose: dict[str, Any]) -> None:
    entrypoint = dockerfile_entrypoint(ROOT / "Dockerfile")
    services = _sluice_services(compose)
    commands = {name: parse_command([*entrypoint, *s["command"]]) for name, s in services.items()}
    assert commands == {
        "migrate": ("migrate",),
        "gateway": ("gateway",),
        "engine": ("worker", "engine"),
        "billing": ("worker", "billing"),
        "quotas": ("worker", "quotas"),
        "tracing": ("worker", "tracing"),
        "batches": ("worker", "batches"),
        "batches-beat": ("worker", "batches-beat"),
    }


def test_a_wrong_command_or_option_fails_the_check() -> None:
    with pytest.raises(AssertionError, match="no command"):
        parse_command(["sluice", "worker", "engines"])
    with pytest.raises(pytest.fail.Exception, match="--engine-workers"):
        parse_command(["sluice", "gateway", "--engine-workers", "2"])


def test_every_sluice_variable_is_a_setting_of_its_process(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    entrypoint = dockerfile_entrypoint(ROOT / "Dockerfile")
    image_env = {k: v for k, v in dockerfile_env(ROOT / "Dockerfile").items() if "$" not in v}
    for service in _sluice_services(compose).values():
        command = parse_command([*entrypoint, *service["command"]])
        check_settings_env(command, _env(service), monkeypatch, ambient=image_env)


def test_a_variable_no_process_reads_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError, match="SLUICE_DRAIN_TIMEOUT_S"):
        check_settings_env(("gateway",), {"SLUICE_DRAIN_TIMEOUT_S": "30"}, monkeypatch)
    with pytest.raises(pytest.fail.Exception, match="SLUICE_KAFKA_BOOTSTRAP"):
        check_settings_env(("worker", "billing"), {"SLUICE_KAFKA_BOOTSTRAP": "kafka"}, monkeypatch)


def test_images_set_only_real_settings() -> None:
    for dockerfile in ("Dockerfile", "Dockerfile.trtllm"):
        names = {k for k in dockerfile_env(ROOT / dockerfile) if k.startswith("SLUICE_")}
        assert names <= settings_fields(EngineWorkerSettings) | settings_fields(GatewaySettings)
    assert dockerfile_entrypoint(ROOT / "Dockerfile.trtllm") == ["sluice", "worker", "engine"]


def test_start_order_waits_for_health_and_the_migration(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        depends_on = service.get("depends_on") or {}
        if isinstance(depends_on, list):  # the short form: started, nothing more
            depends_on = {dep: {"condition": "service_started"} for dep in depends_on}
        for dep, how in depends_on.items():
            assert dep in services, f"{name} depends on a missing service {dep}"
            condition = how["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}: no healthcheck"
            if condition == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is a one-shot job"
    for name in ("gateway", "billing", "batches", "batches-beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == (
            "service_completed_successfully"
        )
    for name in ("gateway", "engine", "billing", "quotas", "tracing", "batches"):
        assert services[name]["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_health_checks_ask_the_ports_the_processes_serve(compose: dict[str, Any]) -> None:
    services = _sluice_services(compose)
    gateway = services.pop("gateway")
    assert "http://127.0.0.1:8000/readyz" in " ".join(gateway["healthcheck"]["test"])
    assert _env(gateway)["SLUICE_PORT"] == "8000"
    services.pop("migrate")
    for name, service in services.items():
        assert _env(service)["SLUICE_METRICS_PORT"] == WORKER_METRICS_PORT, name
        probe = " ".join(service["healthcheck"]["test"])
        # an engine worker is ready once its model is loaded; the others once they run
        path = "/readyz" if name == "engine" else "/metrics"
        assert f"127.0.0.1:{WORKER_METRICS_PORT}{path}" in probe, name


def test_engine_workers_scale_and_drain(compose: dict[str, Any]) -> None:
    engine = compose["services"]["engine"]
    # `--scale engine=N` needs no fixed name and no host port
    assert "container_name" not in engine and "ports" not in engine
    drain_s = float(_env(engine)["SLUICE_DRAIN_TIMEOUT_S"])
    assert drain_s == EngineWorkerSettings.model_fields["drain_timeout_s"].default
    assert _seconds(engine["stop_grace_period"]) >= drain_s + ENGINE_STOP_AFTER_DRAIN_S


def _seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+)([sm])", duration).groups()  # type: ignore[union-attr]
    return float(value) * (60 if unit == "m" else 1)


def test_prometheus_scrapes_every_sluice_process(compose: dict[str, Any]) -> None:
    config = yaml.safe_load((ROOT / "deploy/compose/prometheus.yml").read_text())
    targets: set[str] = set()
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            targets |= set(static["targets"])
        for sd in job.get("dns_sd_configs", []):
            targets |= {f"{name}:{sd['port']}" for name in sd["names"]}
    sluice = _sluice_services(compose)
    wanted = {f"{n}:{WORKER_METRICS_PORT}" for n in sluice if n not in ("gateway", "migrate")}
    assert targets == wanted | {"gateway:8000"}


def test_grafana_gets_the_provisioning_of_deploy_grafana(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    provisioning = ROOT / "deploy/grafana/provisioning"
    wanted = set()
    for path in provisioning.rglob("*.yml"):
        text = "\n".join(ln for ln in path.read_text().splitlines() if "#" not in ln)
        wanted |= set(re.findall(r"\$\{(\w+)\}", text))
    assert wanted and wanted <= set(grafana["environment"])
    dashboards = yaml.safe_load((provisioning / "dashboards/sluice.yml").read_text())
    path = dashboards["providers"][0]["options"]["path"]
    assert f"./deploy/grafana/dashboards:{path}:ro" in grafana["volumes"]


def test_bind_mounts_name_files_of_the_repository(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source}"


def test_spans_go_to_the_collector_and_on_to_jaeger(compose: dict[str, Any]) -> None:
    for name, service in _sluice_services(compose).items():
        assert _env(service)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318", name
    collector = yaml.safe_load((ROOT / "deploy/compose/otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert collector["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]


def test_kafka_runs_kraft_on_the_official_image(compose: dict[str, Any]) -> None:
    kafka = compose["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    bootstrap = {_env(s)["SLUICE_KAFKA_BOOTSTRAP"] for s in _sluice_services(compose).values()}
    assert bootstrap == {"kafka:9092"}
    assert "PLAINTEXT://kafka:9092" in kafka["environment"]["KAFKA_ADVERTISED_LISTENERS"]


def test_ledger_reader_grants_the_tables_the_dashboards_read() -> None:
    sql = (ROOT / "deploy/compose/ledger-reader.sql").read_text()
    panels = (ROOT / "deploy/grafana/dashboards/sluice.json").read_text()
    tables = set(re.findall(r"(?:FROM|JOIN) (\w+)", panels))
    assert tables == {"usage_ledger", "tenants"}
    assert "GRANT SELECT ON usage_ledger, tenants TO grafana_reader" in sql


def test_the_stores_urls_name_the_containers_and_credentials(compose: dict[str, Any]) -> None:
    postgres = compose["services"]["postgres"]["environment"]
    password = _interpolate(postgres["POSTGRES_PASSWORD"])
    user, database = postgres["POSTGRES_USER"], postgres["POSTGRES_DB"]
    for name, service in _sluice_services(compose).items():
        env = _env(service)
        assert env["SLUICE_DATABASE_URL"] == (
            f"postgresql+psycopg://{user}:{password}@postgres:5432/{database}"
        ), name
        assert env["SLUICE_REDIS_URL"].startswith("redis://redis:6379/"), name
