"""Each process's OpenTelemetry TracerProvider, from the standard `OTEL_*` variables.

Called once at the start of every Sluice process (`sluice serve`, `gateway`, each
`worker`). An exporter is built only when the environment asks for one:

    OTEL_TRACES_EXPORTER   otlp | console | none (unset: otlp if an endpoint is set)
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT   OTLP/HTTP receiver
    OTEL_SERVICE_NAME      overrides the process's own name (`sluice-gateway`, ...)
    OTEL_SDK_DISABLED      true: nothing

Otherwise the global provider stays OpenTelemetry's no-op one: spans cost a few attribute
lookups and nothing is exported. Spans leave through a `BatchSpanProcessor` (its own
thread, `OTEL_BSP_*`), so a slow or absent receiver never holds a request up; the SDK
flushes it at exit.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_configured: TracerProvider | None = None


def exporter_name(env: Mapping[str, str]) -> str | None:
    """The exporter the `OTEL_*` variables ask for (`otlp`, `console`), or None."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n]
    if not names:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return "otlp" if endpoint else None
    if names[0] in ("otlp", "console"):
        return names[0]
    if names[0] != "none":
        logger.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none)", names[0])
    return None


def spans_exported(env: Mapping[str, str] | None = None) -> bool:
    """Whether this environment exports spans (`sluice up` starts the tracing worker then)."""
    return exporter_name(os.environ if env is None else env) is not None


def exporter_from_env(env: Mapping[str, str]) -> SpanExporter | None:
    """The span exporter the `OTEL_*` variables ask for, or None (nothing configured)."""
    name = exporter_name(env)
    if name is None:
        return None
    if name == "console":
        return ConsoleSpanExporter()
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol != "http/protobuf":
        logger.warning("OTLP protocol %s is not installed; exporting http/protobuf", protocol)
    # imported here: the exporter pulls in requests and protobuf, needed only when used
    from sluice.tracing.otlp_wire import FastOTLPSpanExporter

    # the SDK's exporter (with our encoder) reads its endpoint (adding /v1/traces to the
    # generic one), headers and timeout from the same variables
    return FastOTLPSpanExporter()


def build_tracer_provider(
    service_name: str, env: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """A provider exporting as `env` (default: os.environ) asks, or None."""
    env = os.environ if env is None else env
    exporter = exporter_from_env(env)
    if exporter is None:
        return None
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are read by Resource.create
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def configure_tracing(service_name: str) -> TracerProvider | None:
    """Install this process's global TracerProvider once; None when nothing is exported.

    Idempotent: a second call returns the first call's provider (or None again)."""
    global _configured
    with _lock:
        if _configured is not None:
            return _configured
        try:
            provider = build_tracer_provider(service_name)
        except Exception:  # a bad exporter setting must not stop the process
            logger.exception("tracing not configured: the OTEL_* settings failed")
            return None
        if provider is None:
            return None
        trace.set_tracer_provider(provider)
        _configured = provider
        logger.info("tracing: exporting spans of %s", service_name)
        return provider


def tracing_enabled() -> bool:
    """Spans of this process are exported (`configure_tracing` installed a provider)."""
    return _configured is not None
