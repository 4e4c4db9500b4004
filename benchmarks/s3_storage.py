"""Durable storage for a Tansu broker in tests and benchmarks: a local s3rver.

s3rver (npm) keeps a bucket's objects in a directory, so a broker killed and started again
on `s3://BUCKET/` finds its topics, offsets and groups. It is installed with npm into a
cache directory when missing (`SLUICE_S3RVER_DIR`, default `~/.cache/sluice/s3rver`) and
run through `s3rver_conditional.js`, which adds the conditional PUTs Tansu's S3 storage
needs and s3rver 3.7 lacks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from sluice.tansu import free_port, wait_for_port

S3RVER_VERSION = "3.7.1"
WRAPPER = Path(__file__).with_name("s3rver_conditional.js")
CREDENTIAL = "S3RVER"  # s3rver's built-in access key and secret


class S3rverMissing(RuntimeError):
    """node or npm is not installed, or npm could not install s3rver."""


def s3rver_dir() -> Path:
    configured = os.environ.get("SLUICE_S3RVER_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "sluice" / "s3rver"


def ensure_s3rver(prefix: Path | None = None) -> Path:
    """The installed s3rver package's directory, installing it with npm first if missing."""
    prefix = prefix or s3rver_dir()
    package = prefix / "node_modules" / "s3rver"
    if (package / "package.json").exists():
        return package
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise S3rverMissing("node and npm are needed for s3rver (apt-get install nodejs npm)")
    prefix.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
         f"s3rver@{S3RVER_VERSION}"],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if done.returncode != 0 or not (package / "package.json").exists():
        raise S3rverMissing(f"npm install s3rver@{S3RVER_VERSION} failed:\n{done.stderr[-2000:]}")
    return package


@dataclass
class S3rver:
    """An s3rver on 127.0.0.1:`port` serving `bucket` from `directory`."""

    directory: Path
    bucket: str = "tansu"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def storage(self) -> str:
        """Tansu's `--storage-engine` for this bucket."""
        return f"s3://{self.bucket}/"

    def tansu_env(self) -> dict[str, str]:
        """What a Tansu process needs to reach it (object_store's AWS_* variables)."""
        return {
            "AWS_ENDPOINT": f"http://127.0.0.1:{self.port}",
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": CREDENTIAL,
            "AWS_SECRET_ACCESS_KEY": CREDENTIAL,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, log: Path | None = None, timeout_s: float = 30.0) -> S3rver:
        package = ensure_s3rver()
        self.directory.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - until stopped
        # s3rver's continuation token (a listing past 1,000 keys, a partition's batches)
        # is DES-encrypted, a cipher of OpenSSL 3's legacy provider only: without it such
        # a listing answers 500 and the broker's fetches of that partition fail
        self.proc = subprocess.Popen(
            ["node", "--openssl-legacy-provider", str(WRAPPER), str(package),
             str(self.directory), str(self.port), self.bucket],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for_port("127.0.0.1", self.port, timeout_s)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
