"""How tests reach real services: fail in CI when one is missing, skip elsewhere
(docs/architecture.md §9)."""

from __future__ import annotations

import os
import socket

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def service_missing(reason: str) -> None:
    """Fail under CI=true (a missing service is a broken CI), skip elsewhere, saying why."""
    if in_ci():
        pytest.fail(f"service unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"service unavailable: {reason}")


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
