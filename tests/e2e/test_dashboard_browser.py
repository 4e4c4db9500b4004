"""`/dashboard` in a real headless Chromium against `sluice serve`: it renders the numbers.

A few chat requests go through the static key (the ledger's `default` tenant); the page,
given the admin key in its URL fragment, must show that tenant's row with its tokens, and
the metrics peer that does not answer as down, the rest of the page live.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.procs import API_KEY, SluiceProcess, free_port, serving_args, wait_ready
from tests.services import service_missing
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
ADMIN_KEY = "sk-e2e-admin-dashboard"
DEAD_PEER = f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens there
SHOT_COPY = os.environ.get("SLUICE_DASHBOARD_SHOT")  # keep the screenshot to look at


@pytest.fixture(scope="module")
def served(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("dashboard") / "serve.log"
    args = serving_args("serve", port, data_dir)
    env = {"SLUICE_ADMIN_KEY": ADMIN_KEY, "SLUICE_METRICS_PEERS": DEAD_PEER}
    proc = SluiceProcess(args, log, env).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base
    finally:
        code = proc.stop()
    assert code == 0, proc.output()[-3000:]


def chromium(tmp_path: Path, url: str, *mode: str) -> subprocess.CompletedProcess[str]:
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        service_missing(f"no Chromium at {CHROMIUM}")
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=8000", "--window-size=1280,900", *mode, url,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def billed_tokens(base: str) -> int:
    """Tokens the ledger holds for today, as `/dashboard/data` reports them."""
    r = httpx.get(f"{base}/dashboard/data", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    r.raise_for_status()
    return sum(int(t["total_tokens"]) for t in r.json()["tenants"]["data"])


def test_the_page_renders_tenants_and_pipeline_numbers(served: str, tmp_path: Path) -> None:
    for i in range(3):
        r = httpx.post(
            f"{served}/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={
                "model": "tiny-llama",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": f"count to {i + 3}"}],
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
    # the billing consumer writes the ledger after the replies: wait for its rows
    wait_until(lambda: billed_tokens(served) > 0, 30, "usage in the ledger", interval_s=0.2)

    url = f"{served}/dashboard#key={ADMIN_KEY}"
    shot = tmp_path / "shot.png"
    run = chromium(tmp_path, url, f"--screenshot={shot}")
    if SHOT_COPY:
        shutil.copy(shot, SHOT_COPY)
    assert shot.exists() and shot.stat().st_size > 10_000, run.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1280, 900)
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 20  # not one flat colour

    dom = chromium(tmp_path, url, "--dump-dom").stdout
    assert 'class="pill live"' in dom, dom[-3000:]
    row = re.search(r'<tr><td>(default)</td><td class="num">([\d,]+)</td>', dom)
    assert row, dom[-3000:]
    assert int(row.group(2).replace(",", "")) >= 3  # requests today
    tokens = re.findall(r'<td class="num">([\d,]+)</td>', dom)
    assert any(int(t.replace(",", "")) > 0 for t in tokens)
    assert re.search(r'<span id="updated">updated \d', dom)
    assert error_text(dom) == ""
    assert f'<span class="down">✕ {DEAD_PEER} (' in dom  # reported, not fatal


def error_text(dom: str) -> str:
    found = re.search(r'<div id="error" role="alert"[^>]*>(.*?)</div>', dom, re.S)
    assert found, dom[-3000:]
    return found.group(1)


def test_a_wrong_key_shows_an_error(served: str, tmp_path: Path) -> None:
    dom = chromium(tmp_path, f"{served}/dashboard#key=sk-wrong", "--dump-dom").stdout
    assert error_text(dom).startswith("the admin key was refused"), dom[-3000:]
    assert "HTTP 401" in error_text(dom)
    assert 'class="pill error"' in dom
