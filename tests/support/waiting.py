"""Polling with a deadline: how the tests wait for real processes."""

from __future__ import annotations

from collections.abc import Callable
import time


def wait_until[T](
    predicate: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 0.02,
) -> T:
    """Poll until ``predicate`` returns something true and return it;
    TimeoutError (naming ``what``) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
