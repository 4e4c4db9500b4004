"""The OpenAI File and Batch objects, as the Files and Batches routes answer them.

Field for field what the `openai` SDK parses (`openai.types.FileObject`, `Batch`,
`FileDeleted`, and the cursor page of a list), built from the batch store's records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice.storage.batches import BatchInfo, FileInfo

Object = dict[str, Any]


def file_object(info: FileInfo) -> Object:
    # A stored file is usable as soon as it is stored: OpenAI's deprecated `status`
    # says "processed" then. Sluice keeps files until they are deleted: no expiry.
    return {
        "id": info.id,
        "object": "file",
        "bytes": info.bytes,
        "created_at": info.created_at,
        "filename": info.filename,
        "purpose": info.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def file_deleted(file_id: str) -> Object:
    return {"id": file_id, "object": "file", "deleted": True}


def batch_object(info: BatchInfo) -> Object:
    return {
        "id": info.id,
        "object": "batch",
        "endpoint": info.endpoint,
        "model": info.model,
        "errors": {"object": "list", "data": info.errors} if info.errors else None,
        "input_file_id": info.input_file_id,
        "completion_window": info.completion_window,
        "status": info.status,
        "output_file_id": info.output_file_id,
        "error_file_id": info.error_file_id,
        "created_at": info.created_at,
        "in_progress_at": info.in_progress_at,
        "expires_at": info.expires_at,
        "finalizing_at": info.finalizing_at,
        "completed_at": info.completed_at,
        "failed_at": info.failed_at,
        "expired_at": info.expired_at,
        "cancelling_at": info.cancelling_at,
        "cancelled_at": info.cancelled_at,
        "request_counts": {
            "total": info.total,
            "completed": info.completed,
            "failed": info.failed,
        },
        "usage": {
            "input_tokens": info.input_tokens,
            "input_tokens_details": {"cached_tokens": info.cached_tokens},
            "output_tokens": info.output_tokens,
            # Sluice's models do not reason apart from their output
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": info.input_tokens + info.output_tokens,
        },
        "metadata": info.metadata,
    }


def cursor_page(objects: Sequence[Object], *, has_more: bool) -> Object:
    """A list page; the SDK asks for the next one with `after=<last_id>` while `has_more`."""
    return {
        "object": "list",
        "data": list(objects),
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
        "has_more": has_more,
    }
