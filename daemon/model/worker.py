"""The one OS thread a node runs torch on (loading, every step, embedding), and its OpenMP team between steps.

One thread: OpenMP (libgomp) gives every OS thread that enters a parallel region a team of its own. Two teams
in one process are more threads than a small host's cores, and libgomp then stops spinning between regions:
each of a step's hundreds of small parallel regions waits on a futex wake-up, and a step with two threads runs
no faster than with one. So torch never runs on the event loop's thread, nor on a second worker.

Between steps: after a parallel region libgomp's workers spin for a while (``GOMP_SPINCOUNT``, 100,000 pauses:
about 3 ms here) before they sleep, which bridges the short gaps between one step's regions. A single stream
through two daemons on one host computes on one, then the other; the first one's workers then spin on the cores
the second computes on, for most of an int8 half-model step. Where another daemon shares the host and the
thread has nothing queued, it *parks* its team (``meshnet_park`` in ``gemv.c``): every thread of it sleeps on a
futex at once, and the next submission wakes them together, the team kept. A lone daemon never parks: its
gaps between steps are short and a spinning team takes the next step without a wake-up.
``MESHNET_PARK=off`` never parks (to measure what parking does).

Measured on a 2-core host, a two-node mesh against one node with every layer, single stream: int8 0.87x with
parking, 0.70x without; float32 0.94x and 0.69x (BENCHMARKS.md, "Against llama.cpp").
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

from daemon.model import native

PARK_ENV = "MESHNET_PARK"  # "off": the team spins and sleeps as libgomp decides


class TorchThread(Executor):
    """A one-thread executor whose thread parks its OpenMP team when idle and ``park_when_idle()`` says so."""

    def __init__(self, name: str = "torch") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.park_when_idle: Callable[[], bool] = lambda: False
        self._parking = os.environ.get(PARK_ENV, "on").strip().lower() not in ("off", "0", "false", "no")
        self.parks = 0  # times the team was parked
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future = Future()
            self._queue.put((future, fn, args, kwargs))
        self._wake()  # after the put: a thread about to park sees the queue or the new epoch
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if cancel_futures:
                    self._cancel_queued()
                self._queue.put(None)
        self._wake()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()

    def _wake(self) -> None:
        if not self._parking:
            return
        lib = native.library()
        if lib is not None and lib.can_park:
            lib.unpark()

    def _park_while_idle(self) -> None:
        """Park the team until there is work. A wake-up may come late: a submission's wake can follow the thread
        through that very work and into its next park, which it then ends with nothing queued; the team parks
        again rather than spin until the next submission."""
        while self._parking and self._queue.empty() and self.park_when_idle():
            lib = native.library()
            if lib is None or not lib.can_park:
                return
            epoch = lib.park_epoch()  # read before looking at the queue again: a submission after it moves it on
            if not self._queue.empty():
                return
            self.parks += 1
            lib.park(epoch)

    def _work(self) -> None:
        while True:
            self._park_while_idle()
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, as ThreadPoolExecutor does
                future.set_exception(exc)
            else:
                future.set_result(result)
