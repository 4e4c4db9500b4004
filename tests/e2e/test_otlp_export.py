"""`sluice serve` exports its traces by OTLP/HTTP to a real receiver: a small HTTP server
in this test that decodes each `ExportTraceServiceRequest` as a collector would.

N requests give N gateway server spans and N inference spans with the responses' token
counts, each pair in one trace; a kill -9 of the engine process mid-stream gives the
request a second attempt, whose `process` subtree joins the same trace as the first's."""

from __future__ import annotations

import gzip
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from sluice.bus.errors import BusUnavailable
from sluice.settings import BusSettings, load_settings
from sluice.tansu import tansu_binary
from tests.e2e.procs import API_KEY, SluiceProcess, free_port, serving, serving_args, wait_ready
from tests.e2e.test_serve_engine_restart import engine_pids
from tests.services import service_missing
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
N = 3


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Span]] = []  # (service.name, span)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def take(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append((str(attrs.get("service.name")), span))

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [s for _, s in self.spans if s.name == name]

    def wait(self, name: str, count: int, timeout_s: float = 30) -> list[Span]:
        wait_until(lambda: len(self.named(name)) >= count, timeout_s, f"{count} {name} spans")
        return self.named(name)


def attrs(span: Span) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in span.attributes}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    yield r
    r.server.shutdown()


@pytest.fixture(scope="module")
def served(
    receiver: Receiver, data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, SluiceProcess]]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME"):
        os.environ.pop(name, None)
    log = tmp_path_factory.mktemp("otlp") / "serve.log"
    with serving(data_dir, log, env) as served_proc:
        yield served_proc


def test_each_request_exports_its_server_and_inference_span_in_one_trace(
    served: tuple[str, SluiceProcess], receiver: Receiver
) -> None:
    base, _ = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    usage: dict[str, tuple[int, int]] = {}
    with client:
        for i in range(N):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Count to {i + 3}"}],
                max_tokens=5 + i,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            request_id = raw.headers["x-request-id"]
            for chunk in raw.parse():
                if chunk.usage is not None:
                    usage[request_id] = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    assert len(usage) == N

    servers = receiver.wait("POST /v1/chat/completions", N)
    inferences = receiver.wait(f"chat {MODEL}", N)
    server_by_id = {attrs(s)["sluice.request_id"]: s for s in servers}
    inference_by_id = {attrs(s)["gen_ai.response.id"]: s for s in inferences}
    assert set(server_by_id) == set(inference_by_id) == set(usage)
    for request_id, (prompt_tokens, completion_tokens) in usage.items():
        server, inference = server_by_id[request_id], inference_by_id[request_id]
        assert server.kind == Span.SPAN_KIND_SERVER
        assert inference.kind == Span.SPAN_KIND_INTERNAL
        assert server.trace_id == inference.trace_id
        a = attrs(inference)
        assert a["gen_ai.usage.input_tokens"] == prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == completion_tokens
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "sluice"
        assert attrs(server)["gen_ai.usage.output_tokens"] == completion_tokens
        assert server.end_time_unix_nano >= inference.end_time_unix_nano
    sends = receiver.named(f"send sluice.requests.{MODEL}.standard.v1")
    assert {s.trace_id for s in sends} >= {s.trace_id for s in servers}
    services = {service for service, _ in receiver.spans}
    assert services == {"sluice"}


def test_a_killed_engine_gives_a_second_attempt_in_the_same_trace(
    served: tuple[str, SluiceProcess], receiver: Receiver
) -> None:
    base, proc = served
    assert proc.proc is not None
    first = engine_pids(proc.proc.pid)
    assert first, "no engine process under sluice serve"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    with client:
        raw = client.completions.with_raw_response.create(
            model=MODEL,
            prompt=[5, 6, 7, 8],
            max_tokens=600,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        request_id = raw.headers["x-request-id"]
        finish = None
        for i, chunk in enumerate(raw.parse()):
            if i == 4:  # mid-stream: 5 chunks of 600 tokens in
                for pid in first:  # the request's engine among them
                    os.kill(pid, signal.SIGKILL)
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
    assert finish == "length"

    def attempts() -> list[Span]:
        found = receiver.named(f"text_completion {MODEL}")
        return [s for s in found if attrs(s)["gen_ai.response.id"] == request_id]

    wait_until(lambda: len(attempts()) >= 2, 30, "both attempts' spans")
    by_attempt = {attrs(s)["sluice.attempt"]: s for s in attempts()}
    assert sorted(by_attempt) == [0, 1]
    assert attrs(by_attempt[0]).get("sluice.estimated") is True  # its engine died under it

    def servers() -> list[Span]:
        found = receiver.named("POST /v1/completions")
        return [s for s in found if attrs(s)["sluice.request_id"] == request_id]

    # the gateway's span ends with the response and goes out in the exporter's next batch
    # (up to 5 s later), possibly after the engine's spans
    wait_until(servers, 30, "the server span")
    [server] = servers()
    assert by_attempt[0].trace_id == by_attempt[1].trace_id == server.trace_id
    processes = [
        s
        for s in receiver.named(f"process sluice.requests.{MODEL}.standard.v1")
        if attrs(s)["sluice.request_id"] == request_id
    ]
    assert sorted(attrs(s)["sluice.attempt"] for s in processes) == [0, 1]
    assert len({s.parent_span_id for s in processes}) == 1  # both under the one send span
    assert attrs(server)["sluice.attempts"] == 2


@pytest.mark.kafka
def test_sluice_up_exports_gateway_and_tracing_worker_spans_in_one_trace(
    data_dir: Path, tmp_path: Path
) -> None:
    """Distributed: the gateway's spans and those `sluice worker tracing` builds from the
    engine worker's telemetry (each process its own service) meet in one trace."""
    try:
        tansu_binary(load_settings(BusSettings).tansu_bin)
    except BusUnavailable as exc:
        service_missing(str(exc))
    receiver = Receiver()
    receiver.thread.start()
    port = free_port()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "SLUICE_ENGINE_GROUP_ID": f"engine-otlp-{uuid.uuid4().hex[:6]}",
    }
    proc = SluiceProcess([*serving_args("up", port, data_dir)], tmp_path / "up.log", env)
    for name in ("SLUICE_KAFKA_BOOTSTRAP", "SLUICE_REDIS_URL", "OTEL_SERVICE_NAME"):
        proc.env.pop(name, None)
    proc.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=30)
        with client:

            def answered() -> Any:
                try:
                    return client.chat.completions.with_raw_response.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "Hi"}],
                        max_tokens=4,
                        temperature=0,
                    )
                except openai.APIError:
                    return None

            # the engine worker may still be joining its group
            raw = wait_until(answered, 120, "an answer", interval_s=1)
        request_id = raw.headers["x-request-id"]
        completion_tokens = raw.parse().usage.completion_tokens  # type: ignore[union-attr]
        wait_until(
            lambda: [s for s in receiver.named(f"chat {MODEL}") if _for(s, request_id)],
            60,
            "the chat span",
            interval_s=0.2,
        )
    finally:
        code = proc.stop()
        receiver.server.shutdown()
    assert code == 0, proc.output()[-3000:]
    services = {id(span): service for service, span in receiver.spans}
    [server] = [s for s in receiver.named("POST /v1/chat/completions") if _for(s, request_id)]
    [inference] = [s for s in receiver.named(f"chat {MODEL}") if _for(s, request_id)]
    assert services[id(server)] == "sluice-gateway"
    assert services[id(inference)] == "sluice-tracing"
    assert server.trace_id == inference.trace_id
    assert attrs(inference)["gen_ai.usage.output_tokens"] == completion_tokens


def _for(span: Span, request_id: str) -> bool:
    a = attrs(span)
    return request_id in (a.get("sluice.request_id"), a.get("gen_ai.response.id"))
