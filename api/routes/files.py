"""`/v1/files`: upload, list, read and delete files, as OpenAI's Files API.

Uploads are batch inputs (`purpose=batch`); the batches service adds the output and
error files of finished batches (`batch_output`). The multipart parser spools an upload
to a temporary file, so the one copy in memory is the bytes handed to the store. A file
of another tenant reads as missing (404).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
from functools import partial
from typing import Any, BinaryIO, Literal

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import Response

from sluice.api.auth import Principal, require_principal
from sluice.api.batch_objects import Object, file_deleted, file_object
from sluice.api.errors import InvalidRequest, NotFound
from sluice.api.routes.batches import (
    BatchControl,
    BatchLimits,
    batch_control,
    by_object_id,
    list_page,
)
from sluice.storage.batches import FileInfo
from sluice.storage.tenants import is_storable

router = APIRouter(prefix="/v1", tags=["files"])

# what the SDK may filter by; Sluice itself stores "batch" and "batch_output" files
Purpose = Literal[
    "assistants",
    "assistants_output",
    "batch",
    "batch_output",
    "fine-tune",
    "fine-tune-results",
    "vision",
    "user_data",
    "evals",
]
MAX_FILENAME_CHARS = 255  # the store's column
# the multipart framing around the file: boundaries, part headers, the purpose field
MULTIPART_SLACK_BYTES = 64 * 1024

# A match starts at a line's first non-blank byte and takes the rest of that line, so
# there is one match per non-empty line; the regex engine skips blank lines in C.
_NON_EMPTY_LINE = re.compile(rb"\S[^\n]*")

FILE_CONTENT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The file's bytes, as uploaded or written",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


def max_upload_bytes(limits: BatchLimits) -> int:
    """The largest `POST /v1/files` body: the largest file plus its multipart framing."""
    return limits.max_file_bytes + MULTIPART_SLACK_BYTES


def count_lines(content: bytes, stop_after: int) -> int:
    """Non-empty lines of `content`, counting no further than `stop_after`."""
    return sum(1 for _ in itertools.islice(_NON_EMPTY_LINE.finditer(content), stop_after))


def read_upload(file: BinaryIO, limits: BatchLimits) -> bytes:
    """The upload's bytes, within the file size and line limits (blocking: a thread)."""
    size = file.seek(0, os.SEEK_END)
    if size > limits.max_file_bytes:
        # OpenAI answers an oversized batch file 400 invalid_request_error too
        raise InvalidRequest(
            f"File is too large: a batch file holds at most {limits.max_file_bytes} bytes, "
            f"this one has {size}",
            param="file",
            code="file_too_large",
        )
    file.seek(0)
    content = file.read()
    if count_lines(content, limits.max_lines + 1) > limits.max_lines:
        raise InvalidRequest(
            f"the file has more than {limits.max_lines} requests (non-empty lines), "
            "the most one batch takes",
            param="file",
            code="too_many_requests",
        )
    return content


def _no_such_file(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id")


async def _own_file(control: BatchControl, principal: Principal, file_id: str) -> FileInfo:
    info = await by_object_id(file_id, partial(control.store.get_file, principal.tenant_id))
    if info is None:
        raise _no_such_file(file_id)
    return info


@router.post("/files")
async def upload_file(
    file: UploadFile = File(..., description="A JSONL file of batch requests."),
    purpose: Literal["batch"] = Form(..., description="Only `batch` files are uploaded."),
    principal: Principal = Depends(require_principal),
    control: BatchControl = Depends(batch_control),
) -> Object:
    """Upload a batch input file (JSONL, one request a line)."""
    filename = file.filename or "upload.jsonl"
    if len(filename) > MAX_FILENAME_CHARS or not is_storable(filename):
        raise InvalidRequest(
            f"file: the filename must be at most {MAX_FILENAME_CHARS} characters, "
            "without control characters",
            param="file",
            code="invalid_value",
        )
    content = await asyncio.to_thread(read_upload, file.file, control.limits)
    info = await asyncio.to_thread(
        control.store.create_file, principal.tenant_id, purpose, filename, content
    )
    return file_object(info)


@router.get("/files")
async def list_files(
    purpose: Purpose | None = Query(None, description="Only files with this purpose."),
    limit: int = Query(10_000, ge=1, le=10_000),
    after: str | None = Query(None, description="The id of the last file of the page before."),
    order: Literal["asc", "desc"] = Query("desc", description="By creation time."),
    principal: Principal = Depends(require_principal),
    control: BatchControl = Depends(batch_control),
) -> Object:
    """The caller's files."""
    return await list_page(
        after,
        limit,
        lambda n: control.store.list_files(
            principal.tenant_id, purpose=purpose, after=after, limit=n, order=order
        ),
        file_object,
    )


@router.get("/files/{file_id}")
async def retrieve_file(
    file_id: str,
    principal: Principal = Depends(require_principal),
    control: BatchControl = Depends(batch_control),
) -> Object:
    """A file of the caller's tenant."""
    return file_object(await _own_file(control, principal, file_id))


@router.get("/files/{file_id}/content", response_class=Response, responses=FILE_CONTENT)
async def file_content(
    file_id: str,
    principal: Principal = Depends(require_principal),
    control: BatchControl = Depends(batch_control),
) -> Response:
    """The file's bytes."""
    content = await by_object_id(file_id, partial(control.store.file_content, principal.tenant_id))
    if content is None:
        raise _no_such_file(file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete("/files/{file_id}")
async def delete_file(
    file_id: str,
    principal: Principal = Depends(require_principal),
    control: BatchControl = Depends(batch_control),
) -> Object:
    """Delete a file of the caller's tenant."""
    if not await by_object_id(file_id, partial(control.store.delete_file, principal.tenant_id)):
        raise _no_such_file(file_id)
    return file_deleted(file_id)
