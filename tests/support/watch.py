"""Polling while a test runs: a thread that polls every node of a mesh (for tests that check a node stays well under
load), and :func:`wait_for`, which waits for a condition."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable

from tests.support.http_client import bearer, send


class NodeWatch:
    """Polls ``path`` on every node, round after round, from entering the ``with`` block to leaving it.

    ``snapshots`` holds ``(node layers, keep(JSON body))`` of every 200; ``bad``, ``(node layers, status or
    error, body)`` of every other answer; ``polls`` counts the rounds.
    """

    def __init__(self, daemons: list, path: str, *, keep: Callable[[dict], object] = lambda body: body,
                 timeout: float = 10.0) -> None:
        self.daemons, self.path, self.keep, self.timeout = daemons, path, keep, timeout
        self.snapshots: list[tuple[str, object]] = []
        self.bad: list[tuple] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for d in self.daemons:
                try:
                    reply = send("GET", d.url + self.path, headers=bearer(d.token), timeout=self.timeout)
                    status, body = reply.status, reply.data
                except (OSError, http.client.HTTPException) as exc:
                    status, body = repr(exc), {}
                if status == 200:
                    self.snapshots.append((d.layers, self.keep(body)))
                else:
                    self.bad.append((d.layers, status, body))
            self.polls += 1
            self._stop.wait(0.1)  # pacing between rounds, not synchronisation

    def __enter__(self) -> NodeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def wait_for(check: Callable[[], object], timeout: float = 20.0, interval: float = 0.05) -> None:
    """Poll ``check`` every ``interval`` seconds until it is true; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(interval)
