"""Waiting in tests on a condition, never on the clock: poll until it holds or fail.

A test that sleeps a fixed time to let something happen is slow on a fast machine and
flaky on a slow one; these return as soon as the condition holds, and the timeout is
only the bound past which the test fails, saying what never happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

POLL_S = 0.01

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float = 10.0,
    what: str = "the condition",
    *,
    interval_s: float = POLL_S,
) -> T:
    """The first truthy value of `predicate()`; AssertionError naming `what` once
    `timeout_s` has passed without one."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
    return value


async def wait_until_async(
    predicate: Callable[[], T],
    timeout_s: float = 10.0,
    what: str = "the condition",
    *,
    interval_s: float = POLL_S,
) -> T:
    """`wait_until` for a coroutine: the event loop runs other tasks between checks."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(interval_s)
    return value
