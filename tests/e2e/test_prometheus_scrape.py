"""A real Prometheus scrapes a `sluice up` stack through the targets file it writes.

`sluice up` (the Tansu broker it starts, one engine worker, billing) writes
`<data_dir>/metrics-targets.json`; Prometheus (`/usr/bin/prometheus`, file_sd, 1 s
scrapes) finds every child there, and after N requests its sum of the TTFT histogram's
count over all targets has grown by exactly N.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.bus.errors import BusUnavailable
from sluice.settings import BusSettings, load_settings
from sluice.tansu import tansu_binary
from tests.e2e.procs import API_KEY, SluiceProcess, free_port, serving_args, wait_ready
from tests.services import service_missing
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

PROMETHEUS = Path("/usr/bin/prometheus")
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
N = 5


@pytest.fixture(scope="module")
def up(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`sluice up` on its own Tansu; (gateway URL, its metrics targets file)."""
    try:
        tansu_binary(load_settings(BusSettings).tansu_bin)
    except BusUnavailable as exc:
        service_missing(str(exc))
    port = free_port()
    log = tmp_path_factory.mktemp("up-metrics") / "up.log"
    env = {"SLUICE_ENGINE_GROUP_ID": f"engine-metrics-{uuid.uuid4().hex[:6]}"}
    proc = SluiceProcess(serving_args("up", port, data_dir), log, env)
    for name in ("SLUICE_KAFKA_BOOTSTRAP", "SLUICE_REDIS_URL", "SLUICE_DATABASE_URL"):
        proc.env.pop(name, None)  # a small fleet: gateway, engine worker, billing
    proc.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        _wait_for_engine(base, proc)
        yield base, data_dir / "metrics-targets.json"
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]


def _chat(client: httpx.Client) -> httpx.Response:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    return client.post("/v1/chat/completions", json={**body, "max_tokens": 4})


def _wait_for_engine(base: str, proc: SluiceProcess) -> None:
    with httpx.Client(base_url=base, headers=_auth(), timeout=60) as client:

        def answered() -> bool:
            try:
                return _chat(client).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(answered, 180, "the engine worker to answer", interval_s=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{proc.output()[-4000:]}") from None


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def prometheus(up: tuple[str, Path], tmp_path: Path) -> Iterator[str]:
    """Prometheus scraping every 1 s the targets `sluice up` wrote; its base URL."""
    if not PROMETHEUS.exists():
        service_missing(f"{PROMETHEUS} is not installed (Debian package prometheus)")
    _, targets = up
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: sluice\n    file_sd_configs:\n"
        f"      - files: [{json.dumps(str(targets))}]\n        refresh_interval: 1s\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 60, "Prometheus to get ready", interval_s=0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _query(base: str, promql: str) -> list[dict]:
    response = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()
    result: list[dict] = response.json()["data"]["result"]
    return result


def _scalar(base: str, promql: str) -> float | None:
    result = _query(base, promql)
    return float(result[0]["value"][1]) if result else None


def _direct_sum(targets: list[str], name: str) -> float:
    """`name` summed over every target, read from their /metrics directly."""
    total = 0.0
    for target in targets:
        text = httpx.get(f"http://{target}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            total += sum(s.value for s in family.samples if s.name == name)
    return total


def test_prometheus_scrapes_every_process_and_counts_each_request(
    up: tuple[str, Path], prometheus: str
) -> None:
    base, targets_file = up
    entries = json.loads(targets_file.read_text())
    processes = {e["labels"]["process"] for e in entries}
    assert {"gateway", "engine-worker-0", "billing"} <= processes, entries
    targets = [t for e in entries for t in e["targets"]]

    # every child answers on its port, as Prometheus sees it
    wait_until(
        lambda: _scalar(prometheus, 'count(up{job="sluice"} == 1)') == len(targets),
        60,
        "every target up",
        interval_s=0.5,
    )

    before = _direct_sum(targets, TTFT_COUNT)
    with httpx.Client(base_url=base, headers=_auth(), timeout=120) as client:
        for _ in range(N):
            assert _chat(client).status_code == 200
    wait_until(
        lambda: _scalar(prometheus, f"sum({TTFT_COUNT})") == before + N,
        60,
        f"Prometheus to count {before + N} first tokens",
        interval_s=0.5,
    )

    # the pipeline's own series come from their processes
    lag = _query(prometheus, 'sluice_consumer_lag_records{group="billing"}')
    assert lag and lag[0]["metric"]["process"] == "billing", lag
    generated = _scalar(prometheus, "sum(vllm:generation_tokens_total)")
    assert generated is not None and generated >= N
    assert _query(prometheus, 'vllm:kv_cache_usage_perc{process="engine-worker-0"}')
