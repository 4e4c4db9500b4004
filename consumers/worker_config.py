"""`EngineWorkerConfig`: the engine worker's tuning, each default written here once.

No more than the bus's topics imported: `sluice.settings` reads these defaults for its
`SLUICE_*` worker settings, and the gateway, which reads settings too, must not load the
worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sluice.bus.topics import Lane


@dataclass(frozen=True, slots=True)
class EngineWorkerConfig:
    """Tuning of one engine worker; `sluice.settings.EngineWorkerSettings` builds it.

    Backpressure: a partition is paused while the engine is full (waiting + pending
    requests at `max_engine_waiting`, the prompt tokens of its requests without a first
    token at `max_engine_waiting_tokens`, KV usage at `max_kv_usage`, or `max_in_engine`
    requests submitted) and `full_engine_lookahead` of its requests are buffered, or
    whenever it has `max_buffered_per_partition` buffered. Pausing per partition (not
    per lane) keeps a tenant's backlog on one partition from blocking the others; the
    lookahead lets the admission buffer see each tenant's next requests.
    """

    group_id: str = "engine"
    lanes: tuple[Lane, ...] = (Lane.INTERACTIVE, Lane.STANDARD, Lane.BATCH)
    lane_weights: Mapping[Lane, int] = field(
        default_factory=lambda: {Lane.INTERACTIVE: 16, Lane.STANDARD: 4, Lane.BATCH: 1}
    )
    tenant_quantum_tokens: int = 256
    poll_timeout_s: float = 0.05
    max_records: int = 64
    # At most one periodic commit per interval; it does not wait for the broker (a waiting
    # one held up the poll thread). Drain and revocation commit the latest watermarks and
    # wait. A later commit only widens what a failover redoes.
    commit_interval_s: float = 0.2
    max_buffered_per_partition: int = 32
    # Lets the fair queue see each tenant's next requests while the engine is full (with
    # 1, a heavy tenant takes the slots through a ramp-up).
    full_engine_lookahead: int = 8
    max_engine_waiting: int = 64
    # about two steps of the engine's default token budget (2,048): see
    # `RequestFlow.engine_full`
    max_engine_waiting_tokens: int = 4096
    max_kv_usage: float = 0.9
    max_in_engine: int = 128
    cancel_ttl_s: float = 600.0
    max_cancelled: int = 100_000
    drain_timeout_s: float = 30.0
    tick_s: float = 0.05
    # Mid-stream deltas of one reply target go out at most this often (first tokens and
    # terminal deltas at once): see `consumers.engine_publisher`. 0 sends every step.
    reply_interval_s: float = 0.01
    control_group_prefix: str = "engine-control"
    # The broker may hold the control consumer's empty fetches this long: cancels reach
    # the engine up to this much later than at the bus default (5 ms), and the broker
    # answers 10x fewer fetches, each of which costs it CPU.
    # None: bus default.
    control_max_wait_ms: int | None = 50
    # A dead engine process is started again after `engine_restart_initial_s`, doubling
    # per death up to `engine_restart_max_s`, back to the start once an engine stayed up
    # `engine_restart_reset_s`. A request the engine died under `max_engine_deaths`
    # times ends with 'error' (it may be what kills it); `engine_max_failed_starts`
    # starts in a row that fail and the worker gives up (unhealthy, it stops).
    restart_engine: bool = True
    engine_restart_initial_s: float = 0.5
    engine_restart_max_s: float = 30.0
    engine_restart_reset_s: float = 60.0
    max_engine_deaths: int = 3
    engine_max_failed_starts: int = 5
    # While the engine is down (it died, or failed to start), the requests held for it
    # wait this long; then they, and what arrives while it stays down, end with a 503
    # naming the cause. The restarts go on meanwhile.
    engine_wait_s: float = 30.0
    # Gateways and workers say they live every `heartbeat_s`; the requests of a gateway
    # silent for `gateway_ttl_s` are cancelled (`consumers.gateway_liveness`); 0: never.
    heartbeat_s: float = 1.0
    gateway_ttl_s: float = 5.0
