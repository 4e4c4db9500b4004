"""`sluice bulk` with the engine's usage records tapped: the money suite's bulk row.

`python -m benchmarks.money_bulk INPUT OUTPUT DATA_DIR` runs INPUT as `sluice bulk`
does in-process (`sluice.cli_bulk._bulk_in_process`: the same settings, window, engine
and line runner), with one more consumer on the usage topic of its in-memory bus, and
prints one JSON line: the run's summary and Σ of the engine's usage records (one per
request attempt, priced as the money suite prices a client's usage).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from benchmarks.money import PRICE, Tally
from sluice import wiring
from sluice.bulk_files import OrderedWriter, Summary, read_input
from sluice.bulk_run import default_window, embedded_engine, run_lines
from sluice.bus.codec import decode_as
from sluice.bus.memory import MemoryEventBus
from sluice.bus.messages import UsageRecord
from sluice.bus.topics import USAGE_TOPIC
from sluice.settings import EngineWorkerSettings, GatewaySettings, load_settings


def main(source: Path, output: Path, data_dir: Path) -> dict[str, object]:
    # the model the suite's lines name, whatever the default
    overrides = {"data_dir": data_dir, "log_level": "WARNING", "model": "tiny-llama"}
    gateway_settings = load_settings(GatewaySettings, **overrides)
    worker_settings = load_settings(EngineWorkerSettings, **overrides)
    served = wiring.served_model(gateway_settings)
    endpoint = json.loads(source.read_text().splitlines()[0])["url"]
    lines = read_input(source.read_bytes(), endpoint, {served.name: served})
    summary = Summary(lines=len(lines))
    bus = MemoryEventBus()
    bus.create_topics(wiring.topic_layout(gateway_settings).specs())
    tap = bus.consumer("money-usage-tap", [USAGE_TOPIC])  # before any record: none trimmed
    window = default_window(worker_settings)
    with output.open("w", encoding="utf-8") as out, embedded_engine(worker_settings, bus):
        writer = OrderedWriter(out, None)
        run = run_lines(bus, gateway_settings, served, endpoint, lines, writer, summary,
                        window=window)  # fmt: skip
        complete = asyncio.run(run)
    records: dict[tuple[str, int], UsageRecord] = {}
    while batch := tap.poll(0.5):
        for record in batch:
            usage = decode_as(UsageRecord, record.value)
            kept = records.get((usage.request_id, usage.attempt))
            if kept is None or (kept.estimated and not usage.estimated):
                records[(usage.request_id, usage.attempt)] = usage
    engine = Tally()
    for u in records.values():
        engine.add(u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                   PRICE.cost_picos(u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                                    batch=False))  # fmt: skip
    return {"summary": {**summary.as_dict(), "complete": complete}, "engine": engine.as_dict()}


if __name__ == "__main__":
    result = main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
    result["engine"].pop("cost_usd")  # type: ignore[attr-defined]
    print(json.dumps(result))
