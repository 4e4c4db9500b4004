"""deploy/k8s: each overlay renders, and every manifest validates offline.

kubectl does not talk to a cluster here: the overlays are rendered by the small renderer
in kustomize.py (checked against `kubectl kustomize` where kubectl is installed), each
Kubernetes object is validated against the Kubernetes v1.37 schemas kept in
deploy/schemas/ (unknown fields rejected, as `kubectl apply --validate=strict` does), the
ScaledObject against KEDA v2.20.2's CRD schema, each container's command line against the
`sluice` CLI and each SLUICE_* variable against the settings of its process. Every model
the gateway serves has an engine Deployment of its pool and a ScaledObject on that pool's
lanes and group.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.bus.topics import Lane, pool_id, request_topic, request_topics
from sluice.settings import BusSettings, EngineWorkerSettings, GatewaySettings, load_settings
from sluice.up import ENGINE_STOP_AFTER_DRAIN_S
from tests.unit.deploy.kustomize import Manifest, render
from tests.unit.deploy.sluice_checks import (
    ROOT,
    SCHEMAS,
    check_settings_env,
    dockerfile_entrypoint,
    errors,
    parse_command,
    validator,
)

OVERLAYS = sorted((ROOT / "deploy/k8s/overlays").iterdir())
KEDA_SCHEMA = SCHEMAS / "keda-scaledobject-v2.20.2.json"
# the Kafka scaler's trigger metadata in KEDA v2.20.2 (pkg/scalers/kafka_scaler.go,
# kafkaMetadata); "<name>FromEnv" reads a resolvedEnv parameter from the container's env
KAFKA_SCALER_PARAMETERS = {
    "bootstrapServers", "bootstrapServersFromEnv", "consumerGroup", "consumerGroupFromEnv",
    "topic", "topicFromEnv", "partitionLimitation", "lagThreshold", "activationLagThreshold",
    "offsetResetPolicy", "allowIdleConsumers", "excludePersistentLag",
    "scaleToZeroOnInvalidOffset", "limitToPartitionsWithLag",
    "ensureEvenDistributionOfPartitions", "version", "tls", "unsafeSsl", "sasl",
    "saslTokenProvider", "awsRegion",
}  # fmt: skip


@pytest.fixture(scope="module", params=OVERLAYS, ids=lambda p: p.name)
def overlay(request: pytest.FixtureRequest) -> list[Manifest]:
    return render(request.param)


def _kubernetes_validators() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) → a validator of that object, from the kept definitions."""
    schema = json.loads((SCHEMAS / "kubernetes-v1.37-strict.json").read_text())
    found = {}
    for name in schema["x-roots"]:
        (gvk,) = schema["$defs"][name]["x-kubernetes-group-version-kind"]
        api_version = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
        found[(api_version, gvk["kind"])] = validator(
            {"$schema": schema["$schema"], "$defs": schema["$defs"], "$ref": f"#/$defs/{name}"}
        )
    return found


def _strict(schema: Any) -> Any:
    """A CRD's structural schema, unknown fields rejected (kubectl's strict validation):
    objects that list their properties and neither allow more nor preserve unknowns."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _keda_validator() -> Any:
    schema = json.loads(KEDA_SCHEMA.read_text())
    return validator(_strict({k: v for k, v in schema.items() if not k.startswith(("$", "x-"))}))


VALIDATORS = {**_kubernetes_validators(), ("keda.sh/v1alpha1", "ScaledObject"): _keda_validator()}


def _validate(manifest: Manifest) -> list[str]:
    key = (manifest["apiVersion"], manifest["kind"])
    assert key in VALIDATORS, f"no schema kept for {key} (deploy/schemas/README.md)"
    return list(errors(VALIDATORS[key], manifest))


def _by_kind(manifests: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def _workloads(manifests: list[Manifest]) -> dict[str, Manifest]:
    return {**_by_kind(manifests, "Deployment"), **_by_kind(manifests, "Job")}


def _container(workload: Manifest) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _environment(manifests: list[Manifest], container: dict[str, Any]) -> dict[str, str]:
    """The container's variables: envFrom's ConfigMaps and Secrets, then its env."""
    maps, secrets = _by_kind(manifests, "ConfigMap"), _by_kind(manifests, "Secret")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env |= maps[source["configMapRef"]["name"]]["data"]
        elif source["secretRef"]["name"] in secrets:
            env |= secrets[source["secretRef"]["name"]]["stringData"]
        else:  # created beside the overlay (prod): every key the dev Secret has
            env |= _by_kind(render(ROOT / "deploy/k8s/overlays/dev"), "Secret")[
                source["secretRef"]["name"]
            ]["stringData"]
    env |= {v["name"]: v["value"] for v in container.get("env", [])}
    return env


def _command(container: dict[str, Any]) -> tuple[str, ...]:
    argv = container.get("command") or dockerfile_entrypoint(ROOT / "Dockerfile")
    return parse_command([*argv, *container.get("args", [])])


def _engines(manifests: list[Manifest]) -> dict[str, Manifest]:
    """The engine worker Deployments: one per model pool."""
    return {
        name: d
        for name, d in _by_kind(manifests, "Deployment").items()
        if _command(_container(d)) == ("worker", "engine")
    }


def _settings(cls: Any, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The settings a process loads from its container's variables alone."""
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("SLUICE_")]:
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        return load_settings(cls)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_renderer_matches_kubectl_kustomize(path: Path) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=True
    ).stdout
    theirs = [m for m in yaml.safe_load_all(out) if m]

    def key(m: Manifest) -> tuple[str, str]:
        return m["kind"], m["metadata"]["name"]

    assert sorted(render(path), key=key) == sorted(theirs, key=key)


def test_every_manifest_validates_against_its_schema(overlay: list[Manifest]) -> None:
    found = {f"{m['kind']}/{m['metadata']['name']}": _validate(m) for m in overlay}
    assert {k: v for k, v in found.items() if v} == {}
    kinds = {m["kind"] for m in overlay}
    assert {"Deployment", "Service", "ConfigMap", "Job", "PodDisruptionBudget"} <= kinds
    assert {"HorizontalPodAutoscaler", "ScaledObject"} <= kinds


def test_the_schemas_reject_unknown_fields_and_bad_types(overlay: list[Manifest]) -> None:
    """The kept schemas are not vacuous: typos and wrong types fail."""
    deployment = copy.deepcopy(_by_kind(overlay, "Deployment")["sluice-engine"])
    _container(deployment)["livenesProbe"] = {}
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    found = "\n".join(_validate(deployment))
    assert "livenesProbe" in found and "60" in found
    scaled = copy.deepcopy(_by_kind(overlay, "ScaledObject")["sluice-engine"])
    scaled["spec"]["maxReplicas"] = 6
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 4
    found = "\n".join(_validate(scaled))
    assert "maxReplicas" in found and "4 is not of type" in found


def test_every_command_and_variable_is_real(
    overlay: list[Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = {}
    for name, workload in _workloads(overlay).items():
        container = _container(workload)
        commands[name] = command = _command(container)
        check_settings_env(command, _environment(overlay, container), monkeypatch)
    engines = {name: ("worker", "engine") for name in _engines(overlay)}
    assert "sluice-engine" in engines
    assert commands == {
        **engines,
        "sluice-migrate": ("migrate",),
        "sluice-gateway": ("gateway",),
        "sluice-billing": ("worker", "billing"),
        "sluice-quotas": ("worker", "quotas"),
        "sluice-tracing": ("worker", "tracing"),
        "sluice-batches": ("worker", "batches"),
        "sluice-batches-beat": ("worker", "batches-beat"),
    }


def test_probes_ask_what_each_process_serves(overlay: list[Manifest]) -> None:
    workloads = _by_kind(overlay, "Deployment")
    gateway = _container(workloads.pop("sluice-gateway"))
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    env = _environment(overlay, gateway)
    assert ports["http"] == int(env.get("SLUICE_PORT", "8000"))
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    for name, workload in workloads.items():
        container = _container(workload)
        metrics_port = int(_environment(overlay, container)["SLUICE_METRICS_PORT"])
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
            "metrics": metrics_port
        }, name
        # an engine worker answers its own probes; the others' metrics answer while they run
        engine = name in _engines(overlay)
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            path = path if engine else "/metrics"
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, name


def test_engine_workers_get_their_drain_before_sigkill(overlay: list[Manifest]) -> None:
    for engine in _engines(overlay).values():
        drain_s = float(_environment(overlay, _container(engine))["SLUICE_DRAIN_TIMEOUT_S"])
        assert drain_s == EngineWorkerSettings.model_fields["drain_timeout_s"].default
        grace_s = engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace_s >= drain_s + ENGINE_STOP_AFTER_DRAIN_S
        assert engine["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_gateway_leaves_the_service_before_it_stops(overlay: list[Manifest]) -> None:
    gateway = _by_kind(overlay, "Deployment")["sluice-gateway"]
    sleep_s = int(_container(gateway)["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert 0 < sleep_s < gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    service = _by_kind(overlay, "Service")["sluice-gateway"]
    assert service["spec"]["selector"] == gateway["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_budgets_and_autoscalers_point_at_real_deployments(overlay: list[Manifest]) -> None:
    deployments = _by_kind(overlay, "Deployment")
    for name, budget in _by_kind(overlay, "PodDisruptionBudget").items():
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    hpa = _by_kind(overlay, "HorizontalPodAutoscaler")["sluice-gateway"]
    assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    # each gateway's share of a limit while Redis is down assumes the fewest replicas
    replicas = _environment(overlay, _container(deployments["sluice-gateway"]))
    assert int(replicas["SLUICE_GATEWAY_REPLICAS"]) == hpa["spec"]["minReplicas"]
    for scaled in _by_kind(overlay, "ScaledObject").values():
        assert scaled["spec"]["scaleTargetRef"]["name"] in deployments
    # two Deployments selecting the same pods would fight over them
    selectors = [
        tuple(sorted(d["spec"]["selector"]["matchLabels"].items())) for d in deployments.values()
    ]
    assert len(selectors) == len(set(selectors))
    beat = deployments["sluice-batches-beat"]["spec"]
    assert beat["replicas"] == 1 and beat["strategy"]["type"] == "Recreate"  # exactly one


def test_each_pool_scales_on_its_own_lanes_lag_interactive_first(
    overlay: list[Manifest], monkeypatch: pytest.MonkeyPatch
) -> None:
    deployments = _by_kind(overlay, "Deployment")
    served: dict[str, str] = {}  # pool → the engine Deployment a ScaledObject sizes
    for name, scaled in _by_kind(overlay, "ScaledObject").items():
        target = deployments[scaled["spec"]["scaleTargetRef"]["name"]]
        engine = _environment(overlay, _container(target))
        settings = _settings(EngineWorkerSettings, engine, monkeypatch)
        pool = pool_id(settings.model_name)
        assert pool not in served, f"{name}: a second ScaledObject of pool {pool}"
        served[pool] = target["metadata"]["name"]
        triggers = {t["metadata"]["topic"]: t for t in scaled["spec"]["triggers"]}
        assert sorted(triggers) == sorted(request_topics(pool)), name
        for topic, trigger in triggers.items():
            metadata = trigger["metadata"]
            assert trigger["type"] == "kafka", topic
            assert set(metadata) <= KAFKA_SCALER_PARAMETERS, topic
            # the group the pool's workers read in (`EngineWorker.group_id`)
            assert metadata["consumerGroup"] == f"{settings.engine_group_id}.{pool}", topic
            assert metadata["bootstrapServersFromEnv"] in engine, topic
            # no committed offsets before a pool's first worker: what waits is lag
            assert metadata["offsetResetPolicy"] == "earliest", topic
        lag = {lane: int(triggers[request_topic(lane, pool)]["metadata"]["lagThreshold"])
               for lane in Lane}  # fmt: skip
        assert lag[Lane.INTERACTIVE] < lag[Lane.STANDARD] < lag[Lane.BATCH], name
        # a worker beyond a lane's partition count would get no partition of it
        partitions = BusSettings.model_fields["request_partitions"].default
        assert scaled["spec"]["maxReplicaCount"] <= partitions, name
        assert scaled["spec"]["minReplicaCount"] >= 0, name
    assert served["tiny-llama"] == "sluice-engine"
    # every model the gateway serves has its scaled pool, and every pool a model served
    gateway = _environment(overlay, _container(deployments["sluice-gateway"]))
    models = _settings(GatewaySettings, gateway, monkeypatch)
    assert sorted(served) == sorted({pool_id(m) for m in [models.model_name, *models.models]})
    assert set(served.values()) == set(_engines(overlay))


def test_the_second_model_overlay_serves_its_own_pool_from_zero() -> None:
    overlay = render(ROOT / "deploy/k8s/overlays/second-model")
    scaled = _by_kind(overlay, "ScaledObject")["sluice-engine-smollm2"]
    assert scaled["spec"]["minReplicaCount"] == 0
    topics = {t["metadata"]["topic"] for t in scaled["spec"]["triggers"]}
    assert topics == set(request_topics("smollm2-135m-instruct"))
    groups = {t["metadata"]["consumerGroup"] for t in scaled["spec"]["triggers"]}
    assert groups == {"engine.smollm2-135m-instruct"}
    gateway = _container(_by_kind(overlay, "Deployment")["sluice-gateway"])
    assert {"name": "SLUICE_MODELS", "value": "smollm2-135m-instruct"} in gateway["env"]


def test_secrets_come_from_the_overlay_or_beside_it(overlay: list[Manifest]) -> None:
    referenced = {
        source["secretRef"]["name"]
        for workload in _workloads(overlay).values()
        for source in _container(workload).get("envFrom", [])
        if "secretRef" in source
    }
    assert referenced == {"sluice-stores", "sluice-gateway-keys"}
    secrets = _by_kind(overlay, "Secret")
    namespace = {m["metadata"]["namespace"] for m in overlay}
    if namespace == {"sluice"}:  # production: never from the repository
        assert secrets == {}
    else:
        assert set(secrets) == referenced


def test_every_object_is_namespaced_and_runs_the_overlays_image(overlay: list[Manifest]) -> None:
    assert all(m["metadata"].get("namespace") for m in overlay)
    images = {_container(w)["image"] for w in _workloads(overlay).values()}
    assert len(images) == 1 and ":" in images.pop()
    for workload in _workloads(overlay).values():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001  # the Dockerfile's USER
