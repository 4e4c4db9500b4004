"""A batch's lifecycle, step by step: validate, dispatch, finalize, cancel, expire, sweep.

Each step reads the batch's state from the store and moves it with a compare-and-set,
so any step may run again, in any process, after any crash: a rerun finds its work done
or picks up the part that is not (docs/architecture.md §14). Celery runs these steps as
tasks (`consumers/batches/tasks.py`); `sluice serve` runs them in-process.

    validating ──▶ in_progress ──▶ finalizing ──▶ completed
        │               │  └────────▶ finalizing (expired_at set) ──▶ expired
        ▼               ▼
      failed        cancelling ──▶ cancelled
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from sluice.api.auth import Principal
from sluice.api.deps import Gateway
from sluice.api.errors import APIError
from sluice.api.prepare import RequestLimits
from sluice.api.served import ModelCatalog, ServedModel
from sluice.api.service import GatewayService
from sluice.api.tenancy import denial
from sluice.billing.batch_budget import BatchBudget
from sluice.bus.base import Delivered, EventBus
from sluice.bus.codec import encode
from sluice.bus.messages import Cancel, GenerateRequest
from sluice.bus.topics import CONTROL_TOPIC, Lane, pool_id, request_topic
from sluice.consumers.batches.lines import (
    BATCH_REPLY_TARGET,
    PreparedLine,
    line_error,
    line_request_id,
    parse_file,
    prepare_line,
    refused_line,
    unrun_line,
)
from sluice.storage.batches import BatchInfo, BatchStore, LineOutcome, NewLine, now_s
from sluice.storage.errors import NotFound, StoreError
from sluice.storage.tenants import TenantRepository
from sluice.tracing.propagation import inject_headers
from sluice.tracing.spans import SendSpan

logger = logging.getLogger(__name__)

CANCELLED_MESSAGE = "This request was not run: the batch was cancelled."
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
STOPPED_CANCELLED_MESSAGE = (
    "This request was stopped part-way: the batch was cancelled. Its usage is what it "
    "consumed before it stopped."
)
STOPPED_EXPIRED_MESSAGE = (
    "This request was stopped part-way: the completion window expired. Its usage is what "
    "it consumed before it stopped."
)


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Settings of batch execution (`SLUICE_BATCH_*`)."""

    max_lines: int = 50_000  # OpenAI's
    queue_tokens: int = 20_000_000  # per tenant: prompt + max_tokens of unfinished lines
    publish_chunk: int = 256  # lines published, then marked queued, at a time
    publish_timeout_s: float = 30.0
    grace_s: float = 30.0  # how long a cancel or expiry waits for the engine's answers
    # a step renews its lease on the batch at least every publish_chunk lines; once a
    # dead step's lease lapsed the sweep reruns it
    lease_s: float = 60.0


class StepLease:
    """One step's hold on a batch in the store: taken at the start, renewed as the step
    goes, released at its end. Two steps never validate or dispatch a batch at once."""

    def __init__(self, store: BatchStore, batch_id: str, ttl_s: float) -> None:
        self.store = store
        self.batch_id = batch_id
        self.ttl_s = ttl_s
        self.owner = uuid.uuid4().hex

    def hold(self) -> bool:
        """Take or renew it; False when another step holds it."""
        return self.store.claim(self.batch_id, self.owner, self.ttl_s)

    def release(self) -> None:
        self.store.release(self.batch_id, self.owner)


class BudgetGate:
    """One dispatch's budget checks for a tenant with a monthly budget: a line is
    published when its cost estimate fits beside the tenant's batch lines in flight;
    it waits (stays pending) while lines in flight may still give budget back, and is
    refused (`insufficient_quota`, costing 0) when nothing is in flight and it does
    not fit (billing/batch_budget.py)."""

    def __init__(self, budget: BatchBudget, store: BatchStore, batch: BatchInfo, limit: int):
        self.budget = budget
        self.tenant_id = batch.tenant_id
        self.limit = limit
        queued = store.queued_tokens(batch.tenant_id)
        self.in_flight_micros = budget.cost_micros(batch.model or "", queued)

    def admit(self, model: str, tokens: int) -> Literal["publish", "wait"] | APIError:
        cost = self.budget.cost_micros(model, tokens)
        decision = self.budget.check(self.tenant_id, self.limit, self.in_flight_micros + cost)
        if decision.allowed:
            self.in_flight_micros += cost
            return "publish"
        if decision.reason == "budget" and self.in_flight_micros == 0:
            return denial(decision)
        return "wait"


class BatchRunner:
    """The steps of every batch, on one store, bus and set of served models."""

    def __init__(
        self,
        store: BatchStore,
        bus: EventBus,
        models: Sequence[ServedModel],
        limits: RequestLimits,
        config: BatchConfig,
        budget: BatchBudget | None = None,
        catalog: ModelCatalog | None = None,
    ) -> None:
        self.store = store
        self.bus = bus
        self.config = config
        self.budget = budget  # None: no tenant store, no budgets
        # `models` with the aliases and LoRA adapters (`api.app.model_catalog`), when given
        self.models = catalog if catalog is not None else ModelCatalog(models)
        # the routes' builders read the reply target from the gateway's service: batch
        # lines answer to the batches collector (never started here: it only names it)
        self.gw = Gateway(
            service=GatewayService(bus, gateway_id=BATCH_REPLY_TARGET),
            models=self.models,
            limits=limits,
            sse_ping_s=15.0,
        )

    # -- validate ------------------------------------------------------------------
    def validate(self, batch_id: str) -> None:
        """validating → in_progress (lines stored, bodies checked, then dispatched),
        or → failed with the file's line errors."""
        batch = self.store.get_batch(batch_id)
        if batch is None or batch.status != "validating":
            if batch is not None and batch.status == "cancelling":
                self.finalize(batch_id, force=True)
            return
        lease = StepLease(self.store, batch_id, self.config.lease_s)
        if not lease.hold():
            return  # another step is validating it
        try:
            batch = self.store.get_batch(batch_id)  # a step that held it may have moved it
            if batch is not None and batch.status == "validating":
                self._validate(batch, lease)
        finally:
            lease.release()

    def _validate(self, batch: BatchInfo, lease: StepLease) -> None:
        batch_id = batch.id
        content = self.store.file_content(batch.tenant_id, batch.input_file_id)
        if content is None:
            error = line_error(-1, "file_not_found", f"file {batch.input_file_id} was deleted")
            self._fail(batch, [{**error, "line": None}])
            return
        principal = self._owner(batch)
        self._refresh_models()
        # a model the owner may not use is not served, as on the routes
        visible = {e.id: e.model for e in self.models.listed(principal)}
        parsed, errors = parse_file(content, batch.endpoint, visible, self.config.max_lines)
        if errors:
            self._fail(batch, errors)
            return
        new_lines: list[NewLine] = []
        refused: list[LineOutcome] = []
        prepared: dict[int, PreparedLine] = {}
        for n, line in enumerate(parsed, 1):
            if n % self.config.publish_chunk == 0 and not lease.hold():
                return  # its lease lapsed and another step took the batch over
            body = json.dumps(line.body, ensure_ascii=False, separators=(",", ":"))
            try:
                ready = self._prepare(batch, principal, line.line, line.custom_id, line.body)
            except APIError as exc:
                new_lines.append(NewLine(line.line, line.custom_id, body))
                request_id = line_request_id(batch_id, line.line)
                refused.append(
                    LineOutcome(line.line, False, refused_line(line.custom_id, request_id, exc))
                )
                continue
            prepared[line.line] = ready
            call = ready.call
            new_lines.append(
                NewLine(
                    line.line,
                    line.custom_id,
                    body,
                    tokens=ready.tokens,
                    requests=len(call.requests),
                    prompt_tokens=call.num_prompt_tokens,
                )
            )
        tokens = sum(ln.tokens for ln in new_lines)
        queued = self.store.enqueued_tokens(batch.tenant_id)
        if queued + tokens > self.config.queue_tokens:
            message = (
                f"the batch needs {tokens} tokens (prompts + max_tokens) and the tenant has "
                f"{queued} enqueued; the limit is {self.config.queue_tokens}. Retry once "
                "earlier batches finish."
            )
            self._fail(batch, [{"code": "token_limit_exceeded", "message": message, "line": None}])
            return
        model = parsed[0].body.get("model")
        self.store.add_lines(batch_id, new_lines, enqueued_tokens=tokens)
        self.store.finish_lines(batch_id, refused)
        if not self.store.move(batch_id, ["validating"], "in_progress", model=model):
            self.finalize(batch_id, force=True)  # cancelled while validating
            return
        logger.info(
            "batch %s in progress: %d lines, %d refused, %d tokens",
            batch_id,
            len(new_lines),
            len(refused),
            tokens,
        )
        self.dispatch(batch_id, prepared, lease=lease)

    def _owner(self, batch: BatchInfo) -> Principal:
        """The batch's owner with its tenant's allowed models as they are now (a tenant
        of no tenant store, a static key's: every model)."""
        try:
            allowed = TenantRepository(self.store.db).get(batch.tenant_id).allowed_models
        except NotFound:
            allowed = None
        models = None if allowed is None else frozenset(allowed)
        return Principal(batch.tenant_id, batch.key_id, allowed_models=models)

    def _refresh_models(self) -> None:
        """The LoRA adapters loaded at run time, as of now (one query per batch)."""
        try:
            self.models.refresh()
        except StoreError as exc:
            logger.warning("LoRA adapter registry not refreshed: %s", exc)

    def _prepare(
        self,
        batch: BatchInfo,
        principal: Principal,
        line: int,
        custom_id: str,
        body: dict[str, Any],
    ) -> PreparedLine:
        return prepare_line(
            self.gw,
            batch.endpoint,
            body,
            principal,
            batch_id=batch.id,
            line=line,
            custom_id=custom_id,
            deadline_ms=batch.expires_at * 1000,
        )

    def _fail(self, batch: BatchInfo, errors: list[dict[str, object]]) -> None:
        if self.store.move(batch.id, ["validating"], "failed", errors=errors):
            logger.info("batch %s failed validation: %s", batch.id, errors[0])

    # -- dispatch ------------------------------------------------------------------
    def dispatch(
        self,
        batch_id: str,
        prepared: dict[int, PreparedLine] | None = None,
        *,
        lease: StepLease | None = None,
    ) -> int:
        """Publish the batch's pending lines to the batch lane, then mark them queued.

        At least once: a crash between the two publishes a chunk again, and the
        duplicate is absorbed (the ledger and the collector key on request and attempt).
        For a tenant with a monthly budget each line first passes its `BudgetGate`: the
        dispatch stops at a line that must wait, and a later one (the sweep's, or
        finalize's once nothing is in flight) goes on from there.
        Under `lease` (validate's), else under a lease of its own: none while another
        step dispatches the batch.
        """
        held = lease or StepLease(self.store, batch_id, self.config.lease_s)
        if lease is None and not held.hold():
            return 0
        try:
            return self._dispatch(batch_id, prepared or {}, held)
        finally:
            if lease is None:
                held.release()

    def _dispatch(self, batch_id: str, prepared: dict[int, PreparedLine], lease: StepLease) -> int:
        batch = self.store.get_batch(batch_id)
        if batch is None or batch.status != "in_progress":
            return 0
        principal = Principal(tenant_id=batch.tenant_id, key_id=batch.key_id)
        gate = self._gate(batch)
        published = 0
        for chunk in self.store.lines(
            batch_id, states=["pending"], chunk=self.config.publish_chunk
        ):
            futures: list[Future[Delivered]] = []
            lines: list[int] = []
            refused: list[LineOutcome] = []
            waiting = False
            for info in chunk:
                ready = prepared.pop(info.line, None)
                if ready is None:
                    ready = self._prepare(
                        batch, principal, info.line, info.custom_id, json.loads(info.body)
                    )
                requests = ready.call.requests
                verdict = "publish" if gate is None else gate.admit(requests[0].model, info.tokens)
                if isinstance(verdict, APIError):
                    result = refused_line(info.custom_id, requests[0].request_id, verdict)
                    refused.append(LineOutcome(info.line, False, result))
                    continue
                if verdict == "wait":
                    waiting = True
                    break
                futures += self._publish(batch, requests)
                lines.append(info.line)
            for future in futures:
                future.result(self.config.publish_timeout_s)
            self.store.mark_queued(batch_id, lines)
            self.store.finish_lines(batch_id, refused)
            published += len(lines)
            if waiting:
                logger.info("batch %s: lines wait for the tenant's budget", batch_id)
                break
            now = self.store.get_batch(batch_id)
            if now is None or now.status != "in_progress":
                break  # cancelled or expired meanwhile: its other lines are not sent
            if not lease.hold():
                break  # the lease lapsed and another step dispatches the rest
        if published:
            logger.info("batch %s: %d lines published", batch_id, published)
        if self.store.unfinished(batch_id) == 0:
            self.finalize(batch_id)
        return published

    def _gate(self, batch: BatchInfo) -> BudgetGate | None:
        if self.budget is None:
            return None
        limit = self.budget.budget_of(batch.tenant_id)
        return None if limit is None else BudgetGate(self.budget, self.store, batch, limit)

    def _publish(
        self, batch: BatchInfo, requests: list[GenerateRequest]
    ) -> list[Future[Delivered]]:
        """A line's records on the batch lane; its trace starts at its send span
        (nothing when tracing is off)."""
        topic = request_topic(Lane.BATCH, pool_id(requests[0].model))
        send = SendSpan(topic, batch.tenant_id, requests[0].request_id, len(requests), batch.id)
        headers = send.headers()
        sent = [
            self.bus.publish(topic, encode(r), key=r.tenant_id.encode(), headers=headers)
            for r in requests
        ]
        send.end_when_sent(sent)
        return sent

    # -- finalize ------------------------------------------------------------------
    def finalize(self, batch_id: str, *, force: bool = False) -> bool:
        """Assemble the output and error files and end the batch, once every line is
        finished (or, for a cancel or expiry, once the grace has passed or `force`)."""
        batch = self.store.get_batch(batch_id)
        if batch is None or batch.terminal or batch.status == "validating":
            return False
        now = now_s()
        if batch.status == "in_progress":
            if batch.expires_at <= now:
                return self.expire(batch_id)
            if self.store.unfinished(batch_id):
                states = self.store.line_states(batch_id)
                if states.get("pending") and not states.get("queued"):
                    self.dispatch(batch_id)  # lines the budget held back until now
                return False
            self.store.move(batch_id, ["in_progress"], "finalizing")
            batch = self.store.get_batch(batch_id)
            assert batch is not None
        if batch.status == "cancelling":
            target, code, message, since = (
                "cancelled",
                "batch_cancelled",
                CANCELLED_MESSAGE,
                batch.cancelling_at,
            )
        elif batch.expired_at is not None:
            target, code, message, since = (
                "expired",
                "batch_expired",
                EXPIRED_MESSAGE,
                batch.expired_at,
            )
        else:
            target, code, message, since = "completed", "", "", None
        if self.store.unfinished(batch_id):
            waited = now - (since or now)
            if target == "completed" or (not force and waited < self.config.grace_s):
                return False
            self._end_lines(batch_id, ["pending", "queued"], code, message)
        output_id, error_id = self._write_files(batch)
        moved = self.store.move(
            batch_id,
            [batch.status],
            target,
            output_file_id=output_id,
            error_file_id=error_id,
            enqueued_tokens=0,
        )
        if moved:
            logger.info("batch %s %s", batch_id, target)
        return moved

    def _end_lines(self, batch_id: str, states: list[str], code: str, message: str) -> None:
        """End the batch's lines in `states` unrun, with error `code`."""
        for chunk in self.store.lines(batch_id, states=states):
            outcomes = [
                LineOutcome(i.line, False, unrun_line(i.custom_id, code, message)) for i in chunk
            ]
            self.store.finish_lines(batch_id, outcomes)

    def _write_files(self, batch: BatchInfo) -> tuple[str | None, str | None]:
        """The output and error files, lines in input order; stable ids, so a rerun
        finds them written."""
        ok: list[str] = []
        failed: list[str] = []
        for chunk in self.store.lines(batch.id):
            for info in chunk:
                if info.result is not None:
                    (ok if info.ok else failed).append(info.result)
        hex_id = batch.id.removeprefix("batch_")
        ids: list[str | None] = []
        for kind, lines in (("output", ok), ("error", failed)):
            if not lines:
                ids.append(None)
                continue
            content = ("\n".join(lines) + "\n").encode()
            stored = self.store.create_file(
                batch.tenant_id,
                "batch_output",
                f"{batch.id}_{kind}.jsonl",
                content,
                file_id=f"file-{hex_id}-{kind}",
            )
            ids.append(stored.id)
        return ids[0], ids[1]

    # -- cancel and expire ---------------------------------------------------------
    def cancel(self, batch_id: str) -> None:
        """A batch moved to cancelling: abort its lines wherever they are (the engine
        answers each running one with its terminal delta), end the unpublished ones."""
        batch = self.store.get_batch(batch_id)
        if batch is None or batch.status != "cancelling":
            return
        self._abort(batch, "batch cancelled")
        self._end_lines(batch_id, ["pending"], "batch_cancelled", CANCELLED_MESSAGE)
        self.finalize(batch_id)

    def expire(self, batch_id: str) -> bool:
        """The window passed: stop the batch's lines; finished lines stay in the output."""
        batch = self.store.get_batch(batch_id)
        if batch is None or batch.status != "in_progress" or batch.expires_at > now_s():
            return False
        if not self.store.move(batch_id, ["in_progress"], "finalizing", expired_at=now_s()):
            return False
        logger.info("batch %s expired", batch_id)
        self._abort(batch, "batch expired")
        self._end_lines(batch_id, ["pending"], "batch_expired", EXPIRED_MESSAGE)
        return self.finalize(batch_id)

    def _abort(self, batch: BatchInfo, reason: str) -> None:
        message = Cancel(batch_id=batch.id, tenant_id=batch.tenant_id, reason=reason)
        future = self.bus.publish(
            CONTROL_TOPIC, encode(message), key=batch.tenant_id.encode(), headers=inject_headers()
        )
        future.result(self.config.publish_timeout_s)

    # -- recovery ------------------------------------------------------------------
    def sweep(self) -> None:
        """Beat's round: expire what ran out of time, finish what is done, and rerun the
        steps of batches whose task was lost."""
        now = now_s()
        for batch in self.store.batches_with_status(
            ["validating", "in_progress", "finalizing", "cancelling"]
        ):
            try:
                self._sweep_one(batch, now)
            except Exception:  # one batch's trouble must not stop the others' sweep
                logger.exception("sweeping batch %s failed", batch.id)

    def _sweep_one(self, batch: BatchInfo, now: int) -> None:
        # validate and dispatch return at once while a live step holds the batch's lease
        if batch.status == "validating":
            self.validate(batch.id)
        elif batch.status == "in_progress":
            if batch.expires_at <= now:
                self.expire(batch.id)
            else:
                self.dispatch(batch.id)  # lines a lost step never published (or none)
                self.finalize(batch.id)
        else:
            self.finalize(batch.id)

    def recover_after_restart(self) -> None:
        """Embedded mode after a restart: the in-memory bus lost every queued line and
        answer, so the unfinished lines of running batches are published again."""
        for batch in self.store.batches_with_status(
            ["validating", "in_progress", "finalizing", "cancelling"]
        ):
            if batch.status == "validating":
                self.validate(batch.id)
                continue
            requeued = self.store.requeue_unfinished(batch.id)
            if batch.status == "in_progress":
                logger.info(
                    "batch %s: %d lines published again after a restart", batch.id, requeued
                )
                self.dispatch(batch.id)
            else:
                self.finalize(batch.id, force=True)
