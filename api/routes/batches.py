"""`/v1/batches`: create, read, list and cancel batches, as OpenAI's Batches API.

The routes only record what the caller asked for in the batch store; the work happens
behind `BatchControl` (consumers/batches): `submitted` starts validating a new batch,
`cancel_requested` aborts the lines of one moved to "cancelling". A batch of another
tenant reads as missing (404), never as forbidden. A tenant whose monthly budget is
spent cannot create a batch: 429 `insufficient_quota`, as every other route answers it
(OpenAI's too); its running batches' lines stop there (`billing/batch_budget.py`).
Store and control calls are synchronous (SQL, a broker), so they run in a thread.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol, TypeVar

from fastapi import APIRouter, Depends, Query
from pydantic import Field, field_validator
from starlette.requests import HTTPConnection

from sluice.api.auth import Principal, require_principal
from sluice.api.batch_objects import Object, batch_object, cursor_page
from sluice.api.deps import Gateway, gateway
from sluice.api.errors import Conflict, InvalidRequest, NotFound, ServiceUnavailable
from sluice.api.schemas import RequestBody
from sluice.api.tenancy import denial
from sluice.billing.batch_budget import BatchBudget
from sluice.storage.batches import BatchInfo, BatchStore

router = APIRouter(prefix="/v1", tags=["batches"])

T = TypeVar("T")
R = TypeVar("R")

CANCELLABLE = ("validating", "in_progress")
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512

# Ids Sluice hands out (`file_<hex>`, `batch_<hex>`) and OpenAI's (`file-…`) fit this;
# anything else names no object, and is never sent to the database (PostgreSQL refuses
# NUL and lone surrogates with an error, not a miss).
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_file_bytes: int = 200 * 1024 * 1024  # OpenAI's
    max_lines: int = 50_000  # OpenAI's requests per batch
    window_s: int = 86_400  # the length of completion_window "24h" (a test setting shortens it)


class BatchControl(Protocol):
    """What the gateway needs from the batches service (consumers/batches)."""

    @property
    def store(self) -> BatchStore: ...

    @property
    def limits(self) -> BatchLimits: ...

    def submitted(self, batch: BatchInfo) -> None:
        """A batch was created: start validating it (enqueues a task; quick)."""
        ...

    def cancel_requested(self, batch: BatchInfo) -> None:
        """A batch moved to "cancelling": abort its lines (quick)."""
        ...


def batch_control(conn: HTTPConnection) -> BatchControl:
    """The app's `BatchControl`; 503 on a gateway built without one (no database)."""
    control: BatchControl | None = getattr(conn.app.state, "batches", None)
    if control is None:
        raise ServiceUnavailable(
            "files and batches need the database: set SLUICE_DATABASE_URL for "
            "`sluice gateway`, or run `sluice serve`",
            code="batches_unavailable",
            # a gateway without a database stays without one: retrying cannot help
            headers={"x-should-retry": "false"},
        )
    return control


def is_object_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


async def by_object_id(object_id: str, call: Callable[[str], T]) -> T | None:
    """`call(object_id)` in a thread; None, without asking the store, for a string that is
    no object id."""
    if not is_object_id(object_id):
        return None
    return await asyncio.to_thread(call, object_id)


async def list_page(
    after: str | None,
    limit: int,
    fetch: Callable[[int], Sequence[R]],
    to_object: Callable[[R], Object],
) -> Object:
    """A list route's page: `fetch(n)` (in a thread) lists up to n records after `after`.

    It is asked for one more than `limit`, which tells whether another page follows. An
    `after` that is no object id follows nothing: an empty page.
    """
    if after is not None and not is_object_id(after):
        return cursor_page([], has_more=False)
    records = await asyncio.to_thread(fetch, limit + 1)
    return cursor_page([to_object(r) for r in records[:limit]], has_more=len(records) > limit)


class BatchCreateBody(RequestBody):
    # fields the SDK may add (`output_expires_after`) are ignored, as on the other routes;
    # strings must be valid Unicode, as in every request body (`RequestBody`)

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(
        default=None,
        description=f"At most {MAX_METADATA_PAIRS} pairs; keys up to "
        f"{MAX_METADATA_KEY_CHARS} characters, values up to {MAX_METADATA_VALUE_CHARS}.",
    )

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters")
            if len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"values are at most {MAX_METADATA_VALUE_CHARS} characters")
            if "\x00" in key or "\x00" in item:
                raise ValueError("keys and values may not hold NUL characters")
        return value


async def _own_batch(control: BatchControl, principal: Principal, batch_id: str) -> BatchInfo:
    batch = await by_object_id(batch_id, lambda i: control.store.get_batch(i, principal.tenant_id))
    if batch is None:
        raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id")
    return batch


async def require_budget_left(gw: Gateway, principal: Principal) -> None:
    """429 `insufficient_quota` (503 with the quota store down) when the tenant's
    monthly budget is spent: none of the batch's lines could run."""
    limits = principal.limits
    if gw.admission is None or limits is None or limits.monthly_budget_micros is None:
        return
    budget = BatchBudget(gw.admission.admission)
    check = partial(budget.check, principal.tenant_id, limits.monthly_budget_micros, 1)
    decision = await asyncio.to_thread(check)
    if not decision.allowed:
        raise denial(decision)


@router.post("/batches")
async def create_batch(
    body: BatchCreateBody,
    principal: Principal = Depends(require_principal),
    control: BatchControl = Depends(batch_control),
    gw: Gateway = Depends(gateway),
) -> Object:
    """Create a batch of requests from an uploaded `purpose=batch` file; it starts in
    `validating`. 429 `insufficient_quota` when the tenant's monthly budget is spent."""
    await require_budget_left(gw, principal)
    store = control.store
    found = await by_object_id(body.input_file_id, partial(store.get_file, principal.tenant_id))
    if found is None or found.purpose != "batch":
        raise InvalidRequest(
            f"input_file_id: no file with purpose 'batch' found with id '{body.input_file_id}'",
            param="input_file_id",
            code="invalid_value",
        )
    create = partial(
        store.create_batch,
        tenant_id=principal.tenant_id,
        key_id=principal.key_id,
        input_file_id=found.id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        window_s=control.limits.window_s,
        metadata=body.metadata,
    )
    batch = await asyncio.to_thread(create)
    await asyncio.to_thread(control.submitted, batch)
    return batch_object(batch)


@router.get("/batches/{batch_id}")
async def retrieve_batch(
    batch_id: str,
    principal: Principal = Depends(require_principal),
    control: BatchControl = Depends(batch_control),
) -> Object:
    """A batch of the caller's tenant."""
    return batch_object(await _own_batch(control, principal, batch_id))


@router.get("/batches")
async def list_batches(
    after: str | None = Query(None, description="The id of the last batch of the page before."),
    limit: int = Query(20, ge=1, le=100),
    principal: Principal = Depends(require_principal),
    control: BatchControl = Depends(batch_control),
) -> Object:
    """The caller's batches, newest first."""
    return await list_page(
        after,
        limit,
        lambda n: control.store.list_batches(principal.tenant_id, after=after, limit=n),
        batch_object,
    )


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(
    batch_id: str,
    principal: Principal = Depends(require_principal),
    control: BatchControl = Depends(batch_control),
) -> Object:
    """Cancel a validating or running batch: it moves to `cancelling`, then `cancelled`
    once its running lines have stopped. Cancelling again answers the batch as it is."""
    batch = await _own_batch(control, principal, batch_id)
    moved = await asyncio.to_thread(control.store.move, batch.id, CANCELLABLE, "cancelling")
    batch = await _own_batch(control, principal, batch_id)
    if moved:
        await asyncio.to_thread(control.cancel_requested, batch)
    elif batch.status not in ("cancelling", "cancelled"):
        raise Conflict(f"cannot cancel a batch that is {batch.status}")
    return batch_object(batch)
