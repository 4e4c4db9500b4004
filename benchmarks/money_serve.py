"""The money suite on `sluice serve`: plain requests, `n` = 4, hung-up streams, batches
(completed, cancelled, expired), `sluice bulk`, and a kill -9 of the engine process.

One `sluice serve` (tiny-llama, a scratch data dir, the admin API on) runs them in turn,
each under a tenant of its own; the batch window is short so one batch expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from benchmarks import sluice_serve
from benchmarks.money import MODEL, Row, Seen, Tally, failed_row, usage_tokens, wanted
from benchmarks.money_clients import (
    ADMIN_KEY,
    Admin,
    Tenant,
    bounded,
    call,
    chat_body,
    completion_body,
    sdk,
    wait_until,
)

API_KEY = "sk-money"
BATCH_WINDOW_S = 8  # what "24h" lasts here: the expired batch's lines outlast it
SERVE_ENV = {"SLUICE_ADMIN_KEY": ADMIN_KEY, "SLUICE_BATCH_WINDOW_S": str(BATCH_WINDOW_S),
             "SLUICE_BATCH_SWEEP_S": "0.5", "SLUICE_BATCH_GRACE_S": "2"}  # fmt: skip
TERMINAL = {"completed", "failed", "expired", "cancelled"}
# a prefix every `n` = 4 request shares, long enough to fill prefix-cache blocks
SHARED_PREFIX = " ".join(f"Rule {i}: answer briefly and stay on topic." for i in range(24))


@dataclass(slots=True)
class Served(sluice_serve.Served):
    admin: Admin


@contextlib.contextmanager
def serve(workdir: Path) -> Iterator[Served]:
    """`sluice serve` with a scratch data dir and a short batch window, tiny-llama priced."""
    with sluice_serve.serve(workdir, API_KEY, SERVE_ENV) as plain:
        database_url = f"sqlite:///{plain.data_dir}/sluice.db"
        served = Served(plain.proc, plain.base_url, plain.data_dir, plain.log,
                        Admin(plain.base_url, database_url))  # fmt: skip
        served.admin.set_price()
        yield served


# -- interactive requests ---------------------------------------------------------------------
def mixed_bodies(rng: random.Random, count: int, **extra: Any) -> list[dict[str, Any]]:
    """`count` requests: chat and completions, unary and streamed, some stopping at EOS."""
    bodies = []
    for i in range(count):
        text = f"Money run {i}: tell me about river number {rng.randint(1, 999)}."
        max_tokens = rng.randint(4, 40)
        more = {"stream": i % 2 == 1, **extra}
        if i % 3:
            more["extra_body"] = {"ignore_eos": True}
        make = chat_body if (i // 2) % 2 == 0 else completion_body
        bodies.append(make(text, max_tokens, **more))
    return bodies


def requests_under(base_url: str, admin: Admin, tenant_name: str, bodies: list[dict[str, Any]],
                   concurrency: int = 16, hang_up_after: int | None = None
                   ) -> tuple[Tenant, list[Seen]]:  # fmt: skip
    """`bodies` sent by a new tenant, `concurrency` at once: the tenant and what it saw."""
    tenant = admin.tenant(tenant_name)
    seen = [Seen() for _ in bodies]

    async def go() -> None:
        async with sdk(base_url, tenant.api_key) as client:
            jobs = [lambda b=b, s=s: call(client, b, s, hang_up_after)
                    for b, s in zip(bodies, seen, strict=True)]  # fmt: skip
            await bounded(jobs, concurrency)

    asyncio.run(go())
    return tenant, seen


def plain(served: Served, quick: bool) -> list[Row]:
    bodies = mixed_bodies(random.Random(1), 16 if quick else 48)
    tenant, seen = requests_under(served.base_url, served.admin, "plain", bodies)
    return [served.admin.settle("plain chat + completions (stream, unary)", tenant, seen)]


def n4(served: Served, quick: bool) -> list[Row]:
    rng = random.Random(2)
    bodies = []
    for i in range(6 if quick else 16):
        text = f"{SHARED_PREFIX} Question {i}: what is {rng.randint(2, 99)} squared?"
        make = chat_body if i % 2 == 0 else completion_body
        bodies.append(make(text, rng.randint(8, 32), n=4, stream=i % 4 >= 2))
    tenant, seen = requests_under(served.base_url, served.admin, "n4", bodies, 4)
    return [served.admin.settle("n = 4, shared prefix", tenant, seen)]


def cancelled(served: Served, quick: bool) -> list[Row]:
    """Streams hung up on after 3 tokens, and complete streams beside them."""
    count = 8 if quick else 24
    hung = [chat_body(f"Long story {i}", 200, stream=True, extra_body={"ignore_eos": True})
            for i in range(count)]  # fmt: skip
    peers = mixed_bodies(random.Random(3), count, stream=True)
    with ThreadPoolExecutor(2) as pool:  # both at once: the hang-ups land among live streams
        futures = {name: pool.submit(requests_under, served.base_url, served.admin, name,
                                      bodies, 8, hang_up_after)
                   for name, bodies, hang_up_after in (("cancel", hung, 3),
                                                       ("cancel-peers", peers, None))}  # fmt: skip
        results = {name: future.result(timeout=180) for name, future in futures.items()}
    return [
        served.admin.settle("streams cancelled by disconnect", *results["cancel"]),
        served.admin.settle("streams beside the cancelled ones", *results["cancel-peers"]),
    ]


def engine_kill(served: Served, quick: bool) -> list[Row]:
    """kill -9 of every engine process under `sluice serve` while streams run."""
    tenant = served.admin.tenant("engine-kill")
    greedy = {"stream": True, "extra_body": {"ignore_eos": True}}
    bodies = [chat_body(f"Kill story {i}", 600, **greedy) for i in range(2)]
    bodies += [completion_body(f"Kill story {i}", 600, **greedy) for i in range(2, 4)]
    seen = [Seen() for _ in bodies]
    victims = sluice_serve.engine_pids(served.proc.pid)
    if not victims:
        raise RuntimeError("no engine process under sluice serve")

    async def go() -> None:
        async with sdk(served.base_url, tenant.api_key) as client:
            pairs = zip(bodies, seen, strict=True)
            tasks = [asyncio.create_task(call(client, b, s)) for b, s in pairs]
            await wait_until(lambda: all(s.received >= 5 for s in seen), "every stream to start")
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            await asyncio.gather(*tasks)

    asyncio.run(go())
    sluice_serve.wait_ready(served, 120)
    row = served.admin.settle("kill -9 of the engine process mid-stream (serve)", tenant, seen)
    row.notes.insert(0, f"killed engine pids {sorted(victims)}")
    return [row]


# -- batches ----------------------------------------------------------------------------------
def _line(custom_id: str, content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _submit(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")  # fmt: skip


def _wait(client: openai.OpenAI, batch_id: str, until: Callable[[Any], bool],
          timeout_s: float = 120.0) -> Any:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL or until(batch):
            return batch
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch still {batch.status} after {timeout_s:.0f}s")
        time.sleep(0.1)


def batch_row(served: Served, scenario: str, lines: list[dict[str, Any]],
              cancel_after: int | None = None) -> Row:  # fmt: skip
    """One batch under a tenant of its own: client-visible = Σ usage of its output and
    error lines; `batch.usage` must equal the ledger too."""
    started = time.monotonic()
    tenant = served.admin.tenant(scenario.split()[0].lower())
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=tenant.api_key,
                           max_retries=0)  # fmt: skip
    with client:
        batch = _submit(client, lines)
        if cancel_after is not None:

            def progressed(b: Any) -> bool:
                counts = b.request_counts
                return bool(counts and counts.completed + counts.failed >= cancel_after)

            _wait(client, batch.id, progressed)
            client.batches.cancel(batch.id)
        batch = _wait(client, batch.id, lambda _: False, timeout_s=180)
        seen = [Seen(usage=u, batch=True) for u in _file_usages(client, batch)]
    row = served.admin.settle(scenario, tenant, seen)
    row.notes.insert(0, f"batch {batch.status}, counts {batch.request_counts}")
    row.extra_ok = batch.usage is not None and _batch_usage(batch.usage) == (
        row.ledger.prompt_tokens,
        row.ledger.cached_tokens,
        row.ledger.completion_tokens,
    )
    if not row.extra_ok:
        shown = _batch_usage(batch.usage) if batch.usage else None
        row.notes.append(f"batch.usage (prompt, cached, completion) = {shown} != ledger")
    row.seconds = time.monotonic() - started
    return row


def _batch_usage(usage: Any) -> tuple[int, int, int]:
    return usage_tokens(usage.model_dump())


def _file_usages(client: openai.OpenAI, batch: Any) -> list[dict[str, Any]]:
    """The usage object of every output and error line that carries one."""
    usages = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if not file_id:
            continue
        for raw in client.files.content(file_id).text.splitlines():
            response = json.loads(raw).get("response") or {}
            usage = (response.get("body") or {}).get("usage")
            if usage:
                usages.append(usage)
    return usages


def batches(served: Served, quick: bool) -> list[Row]:
    done = [_line(f"d{i}", f"Batch question {i}", 6 + i % 10, **({"n": 2} if i % 5 == 0 else {}))
            for i in range(12 if quick else 40)]  # fmt: skip
    long = {"ignore_eos": True}
    cancel = [_line(f"c{i}", f"Batch story {i}", 64, **long) for i in range(400)]
    expire = [_line(f"e{i}", f"Batch essay {i}", 48, **long) for i in range(2000)]
    return [
        batch_row(served, "batch completed", done),
        batch_row(served, "batch cancelled mid-run", cancel, cancel_after=3),
        batch_row(served, "batch expired mid-run", expire),
    ]


# -- sluice bulk --------------------------------------------------------------------------------
def bulk(served: Served, quick: bool) -> list[Row]:
    """`sluice bulk` in a process of its own (`benchmarks.money_bulk`): Σ usage of its
    output lines against the engine's usage records of the same run."""
    workdir = served.data_dir.parent / "bulk"
    workdir.mkdir(exist_ok=True)
    lines = [_line(f"b{i}", f"Bulk question {i}", 4 + i % 24,
                   **({"n": 3} if i % 7 == 0 else {"ignore_eos": True} if i % 2 else {}))
             for i in range(24 if quick else 80)]  # fmt: skip
    source, output = workdir / "in.jsonl", workdir / "out.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.money_bulk", str(source), str(output),
         str(served.data_dir)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"money_bulk exited {done.returncode}: {done.stderr[-2000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    client = Tally()
    for raw in output.read_text().splitlines():
        response = json.loads(raw).get("response") or {}
        usage = (response.get("body") or {}).get("usage")
        if usage:
            client.add_usage(usage)
    engine = Tally(**report["engine"])
    notes = [f"summary: {report['summary']}",
             "engine records counted per attempt; costs at the interactive price"]  # fmt: skip
    return [Row("sluice bulk (output lines vs engine usage)", client, engine,
                against="engine usage records", notes=notes)]  # fmt: skip


# -- the run ------------------------------------------------------------------------------------
SCENARIOS: list[tuple[str, Callable[[Served, bool], list[Row]]]] = [
    ("plain", plain),
    ("n4", n4),
    ("cancelled", cancelled),
    ("batches", batches),
    ("bulk", bulk),
    ("engine kill", engine_kill),  # last: the engine restarts
]


def run(workdir: Path, quick: bool, only: list[str] | None) -> list[dict[str, Any]]:
    todo = [(name, scenario) for name, scenario in SCENARIOS if wanted(name, only)]
    if not todo:
        return []
    rows: list[dict[str, Any]] = []
    with serve(workdir) as served:
        for name, scenario in todo:
            started = time.monotonic()
            try:
                for row in scenario(served, quick):
                    row.seconds = row.seconds or time.monotonic() - started
                    rows.append(row.as_dict())
            except Exception as exc:  # a scenario that breaks is a row, the others still run
                rows.append(failed_row(name, exc, time.monotonic() - started))
    return rows
