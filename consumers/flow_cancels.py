"""Which held requests a cancel ends: a `Cancel` on the control topic, or a gone gateway.

Cancels are remembered (`consumers.cancels`) for requests that arrive later. Heartbeats
come in on the control consumer too; this worker publishes its own, and the requests of
a gateway gone silent are cancelled (`consumers.gateway_liveness`), but for those another
gateway took over. The item's own ending is `ItemEndings.cancel`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sluice.bus.base import Record
from sluice.bus.codec import decode_as, encode
from sluice.bus.errors import DecodeError
from sluice.bus.messages import Cancel, GenerateRequest, Heartbeat, WorkerLoad
from sluice.bus.topics import HEARTBEATS_TOPIC
from sluice.consumers.cancels import CancelRegistry, cancel_matches
from sluice.consumers.flow_endings import ItemEndings
from sluice.consumers.flow_held import HeldRequests
from sluice.consumers.flow_runtime import FlowEnv, ids
from sluice.consumers.gateway_liveness import GatewayLiveness

logger = logging.getLogger(__name__)


class FlowCancels:
    """Control messages in, heartbeats out; cancels the held requests they target."""

    def __init__(
        self,
        env: FlowEnv,
        held: HeldRequests,
        endings: ItemEndings,
        cancels: CancelRegistry,
        gateways: GatewayLiveness,
        load: Callable[[], WorkerLoad] | None = None,
    ) -> None:
        self._bus = env.bus
        self._worker_id = env.worker_id
        self._held = held
        self._endings = endings
        self._cancels = cancels
        self._gateways = gateways
        self._load = load  # this worker's backlog and rates, on its heartbeat (`api.slo`)

    def is_cancelled(self, request: GenerateRequest) -> bool:
        return self._cancels.is_cancelled(request)

    def on_control(self, record: Record) -> None:
        if record.topic == HEARTBEATS_TOPIC:
            self._on_heartbeat(record)
            return
        try:
            cancel = decode_as(Cancel, record.value)
        except DecodeError as exc:
            logger.warning("worker=%s undecodable control message: %s", self._worker_id, exc)
            return
        self._cancels.add(cancel)
        if cancel.request_id is not None:
            item = self._held.get(cancel.request_id)
            targets = [item] if item is not None else []
        else:
            targets = list(self._held)
        for item in targets:
            if cancel_matches(cancel, item.request):
                self._endings.cancel(item)

    def _on_heartbeat(self, record: Record) -> None:
        try:
            self._gateways.heard(decode_as(Heartbeat, record.value))
        except DecodeError as exc:
            logger.warning("worker=%s undecodable heartbeat: %s", self._worker_id, exc)

    def tick(self) -> None:
        """Heartbeat and gone gateways, then forget cancels past their TTL."""
        self._cancel_for_gone_gateways()
        self._cancels.expire()

    def _cancel_for_gone_gateways(self) -> None:
        """Publish this worker's heartbeat when due; cancel what a gone gateway asked for."""
        if self._gateways.due():
            beat = self._gateways.own_beat(self._load() if self._load else None)
            self._bus.publish(HEARTBEATS_TOPIC, encode(beat), key=self._worker_id.encode())
        gone = self._gateways.gone()
        strangers = self._gateways.judging()  # a gateway never heard is gone too
        if not gone and not strangers:
            return
        for item in list(self._held):
            request = item.request
            dead = request.reply_to in gone or (
                strangers and request.reply_beats and self._gateways.never_heard(request.reply_to)
            )
            if dead and item.end is None and not self._gateways.followed(request.request_id):
                logger.warning(
                    "request_id=%s tenant_id=%s cancelled: its gateway %s is gone",
                    *ids(item),
                    item.request.reply_to,
                )
                self._endings.cancel(item)
