"""`configure_tracing`'s reading of the standard OTEL_* variables."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from sluice.tracing.otlp_wire import FastOTLPSpanExporter
from sluice.tracing.setup import build_tracer_provider, exporter_from_env


def test_nothing_configured_is_no_exporter() -> None:
    assert exporter_from_env({}) is None
    assert build_tracer_provider("sluice-gateway", {}) is None


def test_an_endpoint_alone_asks_for_otlp() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert isinstance(exporter_from_env(env), FastOTLPSpanExporter)
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}
    assert isinstance(exporter_from_env(env), OTLPSpanExporter)


def test_the_exporter_variable_decides() -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert exporter_from_env({**endpoint, "OTEL_TRACES_EXPORTER": "none"}) is None
    assert isinstance(exporter_from_env({"OTEL_TRACES_EXPORTER": "console"}), ConsoleSpanExporter)
    assert isinstance(exporter_from_env({"OTEL_TRACES_EXPORTER": "otlp"}), OTLPSpanExporter)
    assert exporter_from_env({"OTEL_TRACES_EXPORTER": "zipkin"}) is None
    assert exporter_from_env({**endpoint, "OTEL_SDK_DISABLED": "true"}) is None


def test_the_service_name_is_the_process_unless_the_environment_names_it() -> None:
    provider = build_tracer_provider("sluice-engine", {"OTEL_TRACES_EXPORTER": "console"})
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "sluice-engine"
    provider.shutdown()
