"""The Files and Batches routes, driven by the official `openai` SDK, on a real SQLite store.

The SDK talks to the app through `TestClient` (an `httpx.Client`), so its multipart
uploads, cursor pages and error classes are exercised as a user's would be. Behind the
routes: a real `BatchStore` and a `BatchControl` that records what it was asked to do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai.types import Batch, FileObject

from sluice.api.app import create_app
from sluice.api.auth import Principal
from sluice.api.errors import AuthenticationFailed
from sluice.api.openapi import Batch as DocumentedBatch
from sluice.api.openapi import BatchList, FileList
from sluice.api.openapi import FileObject as DocumentedFile
from sluice.api.routes.batches import BatchLimits
from sluice.bus.memory import MemoryEventBus
from sluice.storage.batches import BatchInfo, BatchStore, LineOutcome, NewLine
from sluice.storage.db import Database, embedded_url
from tests.unit.api.conftest import gateway_settings
from tests.unit.api.fakes import served_model

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
LIMITS = BatchLimits(max_file_bytes=4096, max_lines=5, window_s=3600)
MAX_BODY_BYTES = 64 * 1024  # gateway_settings(): every other route's limit


def jsonl(n: int) -> bytes:
    line = {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": {}}
    return b"".join(json.dumps({**line, "custom_id": f"r{i}"}).encode() + b"\n" for i in range(n))


class RecordingControl:
    """A `BatchControl` that only records the batches it is handed."""

    def __init__(self, store: BatchStore, limits: BatchLimits) -> None:
        self.store = store
        self.limits = limits
        self.submitted_batches: list[BatchInfo] = []
        self.cancelled_batches: list[BatchInfo] = []

    def submitted(self, batch: BatchInfo) -> None:
        self.submitted_batches.append(batch)

    def cancel_requested(self, batch: BatchInfo) -> None:
        self.cancelled_batches.append(batch)


class KeyAuthenticator:
    """Each key is one tenant's."""

    def __init__(self, principals: dict[str, Principal]) -> None:
        self.principals = principals

    async def authenticate(self, api_key: str | None) -> Principal:
        if api_key not in self.principals:
            raise AuthenticationFailed("incorrect API key provided")
        return self.principals[api_key]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BatchStore]:
    db = Database.connect(embedded_url(tmp_path), migrate_if_needed=True)
    yield BatchStore(db)
    db.close()


@pytest.fixture
def control(store: BatchStore) -> RecordingControl:
    return RecordingControl(store, LIMITS)


@pytest.fixture
def batch_app(memory_bus: MemoryEventBus, control: RecordingControl) -> FastAPI:
    authenticator = KeyAuthenticator(
        {KEY_A: Principal("tenant-a", "key-a"), KEY_B: Principal("tenant-b", "key-b")}
    )
    return create_app(
        gateway_settings(max_body_bytes=MAX_BODY_BYTES),
        memory_bus,
        [served_model("tiny")],
        authenticator,
        batches=control,
    )


@pytest.fixture
def http(batch_app: FastAPI) -> Iterator[TestClient]:
    with TestClient(batch_app, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        yield c


def _sdk(http: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0
    )


@pytest.fixture
def sdk(http: TestClient) -> openai.OpenAI:
    return _sdk(http, KEY_A)


@pytest.fixture
def sdk_b(http: TestClient) -> openai.OpenAI:
    return _sdk(http, KEY_B)


def upload(sdk: openai.OpenAI, content: bytes = b"", name: str = "requests.jsonl") -> FileObject:
    return sdk.files.create(file=(name, content or jsonl(2)), purpose="batch")


def create_batch(sdk: openai.OpenAI, file_id: str, **extra: Any) -> Batch:
    return sdk.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", **extra
    )


# -- files ---------------------------------------------------------------------------


def test_upload_list_retrieve_content_delete(sdk: openai.OpenAI, http: TestClient) -> None:
    content = jsonl(3)
    raw = sdk.files.with_raw_response.create(file=("in.jsonl", content), purpose="batch")
    uploaded = FileObject.model_validate(raw.http_response.json())
    assert (uploaded.object, uploaded.purpose, uploaded.filename) == ("file", "batch", "in.jsonl")
    assert uploaded.bytes == len(content) and uploaded.status == "processed"
    assert uploaded.id.startswith("file")

    assert [f.id for f in sdk.files.list()] == [uploaded.id]
    assert sdk.files.retrieve(uploaded.id) == uploaded
    assert sdk.files.content(uploaded.id).read() == content
    reply = http.get(f"/v1/files/{uploaded.id}/content")
    assert reply.headers["content-type"] == "application/octet-stream"

    deleted = sdk.files.delete(uploaded.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (uploaded.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.delete(uploaded.id)
    assert list(sdk.files.list()) == []


def test_file_list_pages_orders_and_filters(sdk: openai.OpenAI, store: BatchStore) -> None:
    ids = {upload(sdk).id for _ in range(3)}
    store.create_file("tenant-a", "batch_output", "out.jsonl", b"{}\n")

    first = sdk.files.list(purpose="batch", limit=2)
    assert len(first.data) == 2 and first.has_more is True
    body = first.model_dump()
    assert (body["first_id"], body["last_id"]) == (first.data[0].id, first.data[1].id)
    descending = [f.id for f in sdk.files.list(purpose="batch", limit=2)]  # auto-paging
    assert set(descending) == ids and len(descending) == 3
    ascending = [f.id for f in sdk.files.list(purpose="batch", order="asc")]
    assert ascending == descending[::-1]
    assert [f.purpose for f in sdk.files.list(purpose="batch_output")] == ["batch_output"]
    assert len(sdk.files.list().data) == 4


@pytest.mark.parametrize(
    ("query", "param"), [("limit=0", "limit"), ("limit=10001", "limit"), ("order=up", "order")]
)
def test_file_list_refuses_bad_parameters(http: TestClient, query: str, param: str) -> None:
    reply = http.get(f"/v1/files?{query}")
    assert reply.status_code == 400
    assert reply.json()["error"]["param"].endswith(param)  # "query.limit"


def test_upload_refuses_another_purpose(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.files.create(file=("a.jsonl", jsonl(1)), purpose="fine-tune")
    assert (caught.value.param, caught.value.code) == ("purpose", "invalid_value")


def test_upload_counts_non_empty_lines_against_the_limit(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        upload(sdk, jsonl(LIMITS.max_lines + 1))
    assert caught.value.param == "file"
    assert str(LIMITS.max_lines) in caught.value.message
    # blank lines are not requests
    padded = jsonl(LIMITS.max_lines).replace(b"\n", b"\n \r\n\n")
    assert upload(sdk, padded).bytes == len(padded)


def test_upload_size_limits(sdk: openai.OpenAI, http: TestClient) -> None:
    # over the batch file limit, within the upload body limit: 400, as OpenAI answers
    big = b"x" * (LIMITS.max_file_bytes + 1)
    with pytest.raises(openai.BadRequestError) as caught:
        upload(sdk, big)
    assert (caught.value.param, caught.value.code) == ("file", "file_too_large")
    assert upload(sdk, b"x" * LIMITS.max_file_bytes).bytes == LIMITS.max_file_bytes
    # a body past file limit + multipart framing is refused before it is read
    huge = b"x" * (LIMITS.max_file_bytes + 65 * 1024)
    with pytest.raises(openai.APIStatusError) as too_large:
        upload(sdk, huge)
    assert too_large.value.status_code == 413
    # other routes keep their own limit
    reply = http.post("/v1/batches", content=b" " * (MAX_BODY_BYTES + 1))
    assert reply.status_code == 413


BOUNDARY = "sluiceboundary"
MULTIPART = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()


def multipart_head(filename: str) -> bytes:
    """A multipart body up to the file's bytes (which `TAIL` follows), as raw bytes."""
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"'
        "\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode()


def test_chunked_uploads_pass_the_body_limit_chunk_by_chunk(http: TestClient) -> None:
    head, content = multipart_head("c.jsonl"), jsonl(4)

    def body(*parts: bytes) -> Iterator[bytes]:  # no content-length: sent chunked
        yield from parts

    reply = http.post(
        "/v1/files", content=body(head, content[:50], content[50:], TAIL), headers=MULTIPART
    )
    assert reply.status_code == 200, reply.text
    assert http.get(f"/v1/files/{reply.json()['id']}/content").content == content
    oversized = body(head, b"x" * (LIMITS.max_file_bytes + 64 * 1024), TAIL)
    assert http.post("/v1/files", content=oversized, headers=MULTIPART).status_code == 413


def test_upload_refuses_unstorable_filenames(sdk: openai.OpenAI, http: TestClient) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        upload(sdk, name="a" * 256 + ".jsonl")
    assert caught.value.param == "file"
    # the SDK escapes control characters in a filename; another client may not
    raw = multipart_head("bad\x01name.jsonl") + jsonl(1) + TAIL
    reply = http.post("/v1/files", content=raw, headers=MULTIPART)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "file"


def test_ids_that_name_nothing_are_404(http: TestClient) -> None:
    for path in ("/v1/files/%00nul", "/v1/files/" + "a" * 65, "/v1/batches/%F0%9F%98%80"):
        reply = http.get(path)
        assert reply.status_code == 404, path
        assert reply.json()["error"]["type"] == "invalid_request_error"


# -- batches -------------------------------------------------------------------------


def test_create_batch(sdk: openai.OpenAI, control: RecordingControl) -> None:
    file = upload(sdk)
    raw = sdk.batches.with_raw_response.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    batch = Batch.model_validate(raw.http_response.json())
    assert batch.object == "batch" and batch.id.startswith("batch")
    assert (batch.status, batch.input_file_id, batch.endpoint) == (
        "validating",
        file.id,
        "/v1/chat/completions",
    )
    assert batch.expires_at == batch.created_at + LIMITS.window_s
    assert batch.metadata == {"job": "nightly"}
    assert batch.errors is None and batch.output_file_id is None and batch.model is None
    assert batch.request_counts is not None and batch.request_counts.total == 0
    assert batch.usage is not None and batch.usage.total_tokens == 0
    assert [b.id for b in control.submitted_batches] == [batch.id]
    submitted = control.submitted_batches[0]
    assert (submitted.tenant_id, submitted.key_id) == ("tenant-a", "key-a")
    assert sdk.batches.retrieve(batch.id) == batch


def test_batch_object_reports_the_rows_progress(sdk: openai.OpenAI, store: BatchStore) -> None:
    batch = create_batch(sdk, upload(sdk).id)
    lines = [NewLine(i, f"r{i}", "{}", 10) for i in range(3)]
    store.add_lines(batch.id, lines, enqueued_tokens=30)
    store.move(batch.id, ["validating"], "in_progress", model="tiny")
    store.finish_lines(
        batch.id,
        [
            LineOutcome(0, True, "{}", prompt_tokens=7, cached_tokens=4, completion_tokens=5),
            LineOutcome(1, False, "{}"),
        ],
    )
    raw = sdk.batches.with_raw_response.retrieve(batch.id)
    running = Batch.model_validate(raw.http_response.json())
    assert running.status == "in_progress" and running.model == "tiny"
    assert running.in_progress_at is not None
    assert running.request_counts is not None
    assert running.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 1}
    assert running.usage is not None
    assert running.usage.model_dump() == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }

    error = {"code": "invalid_json_line", "line": 2, "message": "not JSON", "param": None}
    other = create_batch(sdk, upload(sdk).id)
    store.move(other.id, ["validating"], "failed", errors=[error])
    failed = Batch.model_validate(
        sdk.batches.with_raw_response.retrieve(other.id).http_response.json()
    )
    assert failed.status == "failed" and failed.failed_at is not None
    assert failed.errors is not None and failed.errors.object == "list"
    assert [e.model_dump() for e in failed.errors.data or []] == [error]


def test_create_batch_needs_an_own_batch_file(
    sdk: openai.OpenAI, sdk_b: openai.OpenAI, store: BatchStore, control: RecordingControl
) -> None:
    output = store.create_file("tenant-a", "batch_output", "out.jsonl", b"{}\n")
    for file_id in ("file_missing", upload(sdk_b).id, output.id, "bad id"):
        with pytest.raises(openai.BadRequestError) as caught:
            create_batch(sdk, file_id)
        assert caught.value.param == "input_file_id", file_id
    assert control.submitted_batches == []


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "48h"}, "completion_window"),
    ],
)
def test_create_batch_refuses_bad_fields(
    http: TestClient, sdk: openai.OpenAI, change: dict[str, Any], param: str
) -> None:
    body = {
        "input_file_id": upload(sdk).id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    reply = http.post("/v1/batches", json={**body, **change})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_create_batch_takes_the_most_metadata_allowed(sdk: openai.OpenAI) -> None:
    metadata = {f"{i:064d}": "v" * 512 for i in range(16)}
    assert create_batch(sdk, upload(sdk).id, metadata=metadata).metadata == metadata


def test_batch_list_pages(sdk: openai.OpenAI, http: TestClient) -> None:
    file_id = upload(sdk).id
    ids = {create_batch(sdk, file_id).id for _ in range(3)}
    first = sdk.batches.list(limit=2)
    assert len(first.data) == 2 and first.has_more is True
    second = first.get_next_page()
    assert len(second.data) == 1 and second.has_more is False
    assert {b.id for b in [*first.data, *second.data]} == ids
    assert {b.id for b in sdk.batches.list(limit=1)} == ids  # auto-paging
    assert sdk.batches.list().has_more is False
    for limit in (0, 101):
        assert http.get(f"/v1/batches?limit={limit}").status_code == 400


def test_cancel(sdk: openai.OpenAI, store: BatchStore, control: RecordingControl) -> None:
    file_id = upload(sdk).id
    validating = create_batch(sdk, file_id)
    cancelling = sdk.batches.cancel(validating.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    assert [(b.id, b.status) for b in control.cancelled_batches] == [(validating.id, "cancelling")]
    # cancelling again answers the batch as it is, and asks for nothing more
    assert sdk.batches.cancel(validating.id).status == "cancelling"
    store.move(validating.id, ["cancelling"], "cancelled")
    assert sdk.batches.cancel(validating.id).status == "cancelled"
    assert len(control.cancelled_batches) == 1

    running = create_batch(sdk, file_id)
    store.move(running.id, ["validating"], "in_progress")
    assert sdk.batches.cancel(running.id).status == "cancelling"
    assert len(control.cancelled_batches) == 2


@pytest.mark.parametrize("status", ["completed", "failed", "expired", "finalizing"])
def test_cancel_refuses_a_finished_batch(
    sdk: openai.OpenAI, store: BatchStore, control: RecordingControl, status: str
) -> None:
    batch = create_batch(sdk, upload(sdk).id)
    store.move(batch.id, ["validating"], status)
    with pytest.raises(openai.ConflictError) as caught:
        sdk.batches.cancel(batch.id)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["message"] == f"cannot cancel a batch that is {status}"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert sdk.batches.retrieve(batch.id).status == status
    assert control.cancelled_batches == []


# -- tenancy, availability, the document ---------------------------------------------


def test_another_tenants_files_and_batches_are_404(
    sdk: openai.OpenAI, sdk_b: openai.OpenAI, control: RecordingControl
) -> None:
    file = upload(sdk)
    batch = create_batch(sdk, file.id)
    for call in (
        lambda: sdk_b.files.retrieve(file.id),
        lambda: sdk_b.files.content(file.id),
        lambda: sdk_b.files.delete(file.id),
        lambda: sdk_b.batches.retrieve(batch.id),
        lambda: sdk_b.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(sdk_b.files.list()) == [] and list(sdk_b.batches.list()) == []
    # nothing of tenant A's changed
    assert sdk.files.retrieve(file.id) == file
    assert sdk.batches.retrieve(batch.id).status == "validating"
    assert control.cancelled_batches == []


def test_without_a_batch_control_every_route_is_503(client: TestClient) -> None:
    upload_form = {"files": {"file": ("a.jsonl", b"{}\n")}, "data": {"purpose": "batch"}}
    batch = {"input_file_id": "file_1", "endpoint": "/v1/completions", "completion_window": "24h"}
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/files", upload_form),
        ("GET", "/v1/files", {}),
        ("GET", "/v1/files/file_1", {}),
        ("GET", "/v1/files/file_1/content", {}),
        ("DELETE", "/v1/files/file_1", {}),
        ("POST", "/v1/batches", {"json": batch}),
        ("GET", "/v1/batches", {}),
        ("GET", "/v1/batches/batch_1", {}),
        ("POST", "/v1/batches/batch_1/cancel", {}),
    ]
    for method, path, kwargs in calls:
        reply = client.request(method, path, **kwargs)
        assert reply.status_code == 503, (method, path, reply.text)
        error = reply.json()["error"]
        assert error["code"] == "batches_unavailable" and "SLUICE_DATABASE_URL" in error["message"]
        assert reply.headers["x-should-retry"] == "false"


def test_the_document_describes_what_the_routes_answer(
    sdk: openai.OpenAI, http: TestClient
) -> None:
    doc = http.get("/openapi.json").json()
    upload_body = doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert "multipart/form-data" in upload_body
    content = doc["paths"]["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    assert set(content) == {"application/octet-stream"}
    cancel = doc["paths"]["/v1/batches/{batch_id}/cancel"]["post"]["responses"]
    assert {"200", "401", "404", "409", "503"} <= set(cancel)

    file = upload(sdk)
    DocumentedFile.model_validate(http.get(f"/v1/files/{file.id}").json())
    FileList.model_validate(http.get("/v1/files").json())
    batch = create_batch(sdk, file.id)
    DocumentedBatch.model_validate(http.get(f"/v1/batches/{batch.id}").json())
    BatchList.model_validate(http.get("/v1/batches").json())


def test_create_batch_is_refused_once_the_monthly_budget_is_spent(
    tmp_path: Path, memory_bus: MemoryEventBus
) -> None:
    """Issue 33: a tenant refused `insufficient_quota` everywhere else ran a batch to
    11.8x its budget. Creating one is a 429 insufficient_quota now, as OpenAI answers
    any request of an account out of quota; nothing is stored or started."""
    from sluice.billing import admin
    from sluice.billing.admission import AdmissionService
    from sluice.storage.keys import KeyAuthenticator as TenantKeys
    from sluice.storage.prices import PriceBook, PriceCache
    from sluice.storage.quota_memory import MemoryQuotaStore
    from sluice.storage.quotas import Settlement

    db = Database.connect(embedded_url(tmp_path / "tenancy"), migrate_if_needed=True)
    tenant = admin.create_tenant(db, "acme", monthly_budget_usd="0.0001")  # 100 micro-dollars
    quotas = MemoryQuotaStore()
    admission = AdmissionService(TenantKeys(db), quotas, PriceCache(PriceBook(db)))
    control = RecordingControl(BatchStore(db), LIMITS)
    app = create_app(
        gateway_settings(), memory_bus, [served_model("tiny")], admission=admission,
        batches=control,
    )  # fmt: skip
    with TestClient(app) as http:
        sdk = _sdk(http, str(tenant["api_key"]))
        file = upload(sdk, jsonl(1))
        ok = sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert ok.status == "validating"
        quotas.settle(Settlement(str(tenant["tenant_id"]), "req_spent", 0, 100, 100))
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.batches.create(
                input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
    error = refused.value
    assert error.status_code == 429 and error.code == "insufficient_quota"
    assert error.response.headers["x-should-retry"] == "false"
    assert [b.id for b in control.submitted_batches] == [ok.id]
    assert [b.id for b in control.store.list_batches(str(tenant["tenant_id"]))] == [ok.id]
    db.close()
