"""The watchdog's thread in one process, against an in-memory store (the multi-rank behaviour is
tests/test_faults.py's)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest

from rannc import health

pytestmark = pytest.mark.layer("pure")


class _Store:
    """The store calls the watchdog makes, in memory; each call records its thread and can be
    slowed down (a store call in progress is the window the test looks at)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.data: dict[str, Any] = {}
        self.delay = delay
        self.calls: list[tuple[str, float]] = []  # (thread name, when)
        self.lock = threading.Lock()

    def _call(self) -> None:
        with self.lock:
            self.calls.append((threading.current_thread().name, time.monotonic()))
        time.sleep(self.delay)

    def set(self, k: str, v: str) -> None:
        self._call()
        self.data[k] = v

    def get(self, k: str) -> str:
        self._call()
        return self.data[k]

    def check(self, keys: list[str]) -> bool:
        self._call()
        return all(k in self.data for k in keys)

    def add(self, k: str, n: int) -> int:
        self._call()
        self.data[k] = int(self.data.get(k, 0)) + n
        return self.data[k]

    def compare_set(self, k: str, old: str, new: str) -> str:
        self._call()
        if self.data.get(k, "") == old:
            self.data[k] = new
        return self.data[k]


def test_close_stops_the_watchdog_thread_before_it_returns() -> None:
    # A daemon thread left inside a store call (native code) when the interpreter finalises is
    # ended by a forced unwind and the process aborts after the script finished ("terminate
    # called without an active exception", seen once in CI): close() must leave no watchdog
    # thread running and no store call of it after close() returned.
    store = _Store(delay=0.002)
    peer = {"step": 0, "phase": "start-up", "pid": os.getpid(), "host": "elsewhere", "since": 0.0}
    store.data["beat/1"] = json.dumps(peer)
    h = health.Health(store, rank=0, world=2, timeout_s=10)
    h.begin()
    deadline = time.monotonic() + 5
    while not any(name == "rannc-watchdog" for name, _ in store.calls):
        assert time.monotonic() < deadline, "the watchdog thread never called the store"
        time.sleep(0.01)
    h.close()
    closed_at = time.monotonic()
    assert not h._thread.is_alive()
    time.sleep(3 * health.POLL_S)
    late = [t for name, t in store.calls if name == "rannc-watchdog" and t > closed_at]
    assert late == [], f"the watchdog called the store {len(late)} times after close()"
    assert json.loads(store.data["beat/0"])["phase"] == health.EXITED
    assert store.data["exited"] == 1
