"""Threads started together, for the contract suites' races."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_together(
    count: int, work: Callable[[int], object], *, timeout: float | None = None
) -> list[BaseException]:
    """Run ``work(0)`` ... ``work(count - 1)`` on ``count`` threads released at
    once by a barrier, wait for them (each up to ``timeout``), and return what
    they raised, so the test asserts it on its own thread."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait(timeout)
            work(index)
        except BaseException as exc:  # noqa: BLE001 - returned to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return errors


__all__ = ["run_together"]
