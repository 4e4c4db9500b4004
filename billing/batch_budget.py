"""The tenant's monthly budget applied to batch lines: checked when a batch is created and
before each line is published, settled as each line finishes (docs/architecture.md §14).

Batch lines hold no reservation in the quota store: a reservation is also a concurrency
lease, and a line may wait in the batch queue for hours, holding the tenant's
interactive traffic back all that time. A line is published only if the quota store
admits, under a check id given back at once, an estimate of the tenant's batch lines in
flight plus this one (prompt + max_tokens each, at the batch price) on top of the
month's spend and the estimates of the tenant's interactive requests. Requests per
minute, tokens per minute and concurrency do not apply to batch lines: a batch has its
own queue limit (`SLUICE_BATCH_QUEUE_TOKENS`), as OpenAI's have.

A finished line's requests are settled from their terminal deltas (by the batches
collector, as the gateway settles its own), deduplicated with the quotas consumer by
(request_id, attempt): the line's cost is in the spend before it leaves the in-flight
estimate, so the next check sees it.
"""

from __future__ import annotations

import time
import uuid

from sluice.billing.admission import AdmissionService
from sluice.bus.messages import Usage
from sluice.bus.topics import Lane
from sluice.storage.errors import NotFound
from sluice.storage.quotas import Decision, Reservation, release
from sluice.storage.tenants import PlanLimits, TenantRepository


class BatchBudget:
    """Budget checks and settlement for batch lines, over the gateway's admission."""

    def __init__(self, admission: AdmissionService, limits_ttl_s: float = 5.0) -> None:
        self.admission = admission
        self.limits_ttl_s = limits_ttl_s
        self._tenants = TenantRepository(admission.auth.db)
        self._budgets: dict[str, tuple[float, int | None]] = {}

    def budget_of(self, tenant_id: str) -> int | None:
        """The tenant's monthly budget in micro-dollars (None: no budget, or no tenant:
        the static keys' "default"), read again after `limits_ttl_s`."""
        now = time.monotonic()
        cached = self._budgets.get(tenant_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            budget = self._tenants.get(tenant_id).limits.monthly_budget_micros
        except NotFound:
            budget = None
        self._budgets[tenant_id] = (now + self.limits_ttl_s, budget)
        return budget

    def cost_micros(self, model: str, tokens: int) -> int:
        """An upper bound of what `tokens` (prompts + max_tokens) cost at the batch price,
        whichever of input and output they turn out to be."""
        price = self.admission.prices.get(model)
        if price is None:
            return 0
        return max(
            price.estimate_micros(tokens, 0, batch=True),
            price.estimate_micros(0, tokens, batch=True),
        )

    def check(self, tenant_id: str, budget: int, cost_micros: int) -> Decision:
        """Whether `cost_micros` more fits the budget now; holds nothing afterwards."""
        quotas = self.admission.quotas
        check_id = f"batch-check-{uuid.uuid4().hex}"
        limits = PlanLimits(monthly_budget_micros=budget)
        decision = quotas.admit(limits, Reservation(tenant_id, check_id, 0, 0, cost_micros))
        if decision.allowed:
            release(quotas, tenant_id, check_id, 0)
        return decision

    def settle(self, tenant_id: str, request_id: str, model: str, usage: Usage) -> bool:
        """Settle attempt 0 of a batch line's request from its terminal delta's usage."""
        return self.admission.settle_terminal(
            tenant_id=tenant_id,
            request_id=request_id,
            attempt=0,
            model=model,
            lane=Lane.BATCH,
            usage=usage,
        )
