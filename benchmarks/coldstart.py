"""`sluice bench coldstart`: time to first token from a pool at zero, beside a warm pool.

A Tansu broker and a `sluice gateway` serving the configured model; its pool has no engine
worker. Each round sends `waiting` streaming requests, waits `idle_s`, then starts one
`sluice worker engine` (the sim backend, then the torch engine on the model), as KEDA or
an operator would once the topic's lag shows. The requests wait in the pool's topics and
complete once the worker is up. Reported per backend (median of the rounds): worker start
to its /readyz, worker start to the first and last request's first token, the clients'
TTFT, and the same requests sent again to the now warm worker; the ratio cold / warm TTFT.
Each round's worker is stopped before the next: the next round starts from zero again, on
the same consumer group (its committed offsets, as a pool that scaled down keeps them).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from sluice.settings import BusSettings, ModelSettings, load_settings
from sluice.tansu import TansuBroker, free_port

API_KEY = "sk-bench-coldstart"
MAX_TOKENS = 16


def _start(args: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "sluice", *args], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    finally:
        out.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> float:
    """Seconds until `url` answers 200; raises with the log when the process dies first."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name} exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f}s: see {log}")


def _first_token_at(base: str, model: str, prompt: str, out: list[float | None]) -> None:
    """Streams one chat completion; appends the monotonic time of its first content."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    first: float | None = None
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=300
    ) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.monotonic()
    out.append(first)


def _send(
    base: str, model: str, waiting: int, tag: str
) -> tuple[float, list[threading.Thread], list[float | None]]:
    firsts: list[float | None] = []
    threads = [
        threading.Thread(
            target=_first_token_at, args=(base, model, f"{tag} {i}: tell me a story", firsts)
        )
        for i in range(waiting)
    ]
    sent = time.monotonic()
    for thread in threads:
        thread.start()
    return sent, threads, firsts


def _round(
    base: str,
    model: str,
    backend: str,
    env: dict[str, str],
    waiting: int,
    idle_s: float,
    logs: Path,
    n: int,
) -> dict[str, float]:
    sent, threads, firsts = _send(base, model, waiting, f"cold {backend} {n}")
    time.sleep(idle_s)
    metrics_port = free_port()
    log = logs / f"worker-{backend}-{n}.log"
    worker_env = {**env, "SLUICE_BACKEND": backend, "SLUICE_METRICS_PORT": str(metrics_port)}
    started = time.monotonic()
    worker = _start(["worker", "engine"], worker_env, log)
    try:
        ready_s = _wait_http(f"http://127.0.0.1:{metrics_port}/readyz", worker, 300, log)
        for thread in threads:
            thread.join(300)
        got = [f for f in firsts if f is not None]
        if len(got) != waiting:
            raise RuntimeError(f"{waiting - len(got)} of {waiting} cold requests got no token")
        warm_sent, warm_threads, warm_firsts = _send(base, model, waiting, f"warm {backend} {n}")
        for thread in warm_threads:
            thread.join(300)
        warm = [f - warm_sent for f in warm_firsts if f is not None]
    finally:
        _stop(worker)
    return {
        "ready_s": ready_s,
        "start_to_first_token_s": min(got) - started,
        "start_to_last_first_token_s": max(got) - started,
        "cold_ttft_s": statistics.median(f - sent for f in got),
        "warm_ttft_s": statistics.median(warm),
    }


def run(
    backends: Sequence[str] = ("sim", "torch"),
    rounds: int = 3,
    waiting: int = 4,
    idle_s: float = 1.0,
) -> dict[str, Any]:
    model = load_settings(ModelSettings)
    logs = Path(tempfile.mkdtemp(prefix="sluice-bench-coldstart-"))
    result: dict[str, Any] = {
        "model": model.model_name,
        "waiting_requests": waiting,
        "idle_s": idle_s,
        "rounds": rounds,
        "logs": str(logs),
        "backends": {},
    }
    with TansuBroker(binary=load_settings(BusSettings).tansu_bin) as broker:
        port = free_port()
        env = {
            **os.environ,
            "SLUICE_KAFKA_BOOTSTRAP": broker.bootstrap,
            "SLUICE_API_KEYS": API_KEY,
            "SLUICE_DATA_DIR": str(logs / "data"),
        }
        env.pop("SLUICE_METRICS_PORT", None)
        gateway = _start(
            ["gateway", "--port", str(port), "--no-announce"], env, logs / "gateway.log"
        )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_http(f"{base}/readyz", gateway, 300, logs / "gateway.log")
            for backend in backends:
                group_env = {**env, "SLUICE_ENGINE_GROUP_ID": f"coldstart-{uuid.uuid4().hex[:6]}"}
                runs = [
                    _round(base, model.model_name, backend, group_env, waiting, idle_s, logs, n)
                    for n in range(rounds)
                ]
                summary = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
                summary["cold_over_warm_ttft"] = round(
                    summary["cold_ttft_s"] / summary["warm_ttft_s"], 1
                )
                result["backends"][backend] = {"median": summary, "runs": runs}
        finally:
            _stop(gateway)
    return result


def render(result: dict[str, Any]) -> str:
    lines = [
        f"cold start from zero: {result['model']}, {result['waiting_requests']} requests waiting,"
        f" worker started {result['idle_s']:g}s after them; median of {result['rounds']} rounds",
        f"{'backend':<8} {'ready':>8} {'→1st tok':>9} {'→last 1st':>10} {'cold TTFT':>10}"
        f" {'warm TTFT':>10} {'cold/warm':>10}",
    ]
    for backend, row in result["backends"].items():
        m = row["median"]
        lines.append(
            f"{backend:<8} {m['ready_s']:>7.2f}s {m['start_to_first_token_s']:>8.2f}s"
            f" {m['start_to_last_first_token_s']:>9.2f}s {m['cold_ttft_s']:>9.2f}s"
            f" {m['warm_ttft_s']:>9.3f}s {m['cold_over_warm_ttft']:>9.1f}x"
        )
    lines.append(f"logs: {result['logs']}")
    return "\n".join(lines)
