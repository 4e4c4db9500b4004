"""Remembered cancels: a request's for minutes, a batch's for its whole window."""

from __future__ import annotations

from sluice.bus.messages import Cancel, GenerateRequest, SamplingSpec
from sluice.consumers.cancels import CancelRegistry


def _request(request_id: str, batch_id: str | None = None, tenant: str = "t1") -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        tenant_id=tenant,
        model="m",
        prompt_token_ids=[1],
        sampling=SamplingSpec(max_tokens=1),
        reply_to="gw",
        created_ms=0,
        batch_id=batch_id,
    )


def test_a_batch_cancel_outlives_a_request_cancel() -> None:
    now = [0.0]
    registry = CancelRegistry(ttl_s=10, batch_ttl_s=1000, clock=lambda: now[0])
    registry.add(Cancel(batch_id="batch_1", tenant_id="t1"))
    registry.add(Cancel(request_id="r1", tenant_id="t1"))
    now[0] = 11.0
    registry.expire()
    assert not registry.is_cancelled(_request("r1"))
    assert registry.is_cancelled(_request("line-3", batch_id="batch_1"))
    assert not registry.is_cancelled(_request("line-3", batch_id="batch_1", tenant="t2"))
    now[0] = 1001.0
    assert not registry.is_cancelled(_request("line-3", batch_id="batch_1"))
