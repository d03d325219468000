"""The node's torch thread (``daemon.model.worker``): an executor of one thread that parks its OpenMP team when idle.

Parking is checked where it shows: with ``OMP_WAIT_POLICY=ACTIVE`` libgomp's workers spin forever between
parallel regions, so an idle process burns a core until its team is parked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from daemon.model import native
from daemon.model.worker import TorchThread
from tests.support.watch import wait_for

needs_library = pytest.mark.skipif(native.library() is None,
                                   reason="no C compiler here: nothing parks")


def test_it_runs_work_in_order_on_one_thread_and_hands_back_results_and_errors():
    thread = TorchThread("test-torch")
    try:
        names = [thread.submit(lambda: threading.current_thread().name) for _ in range(3)]
        assert {f.result(timeout=5) for f in names} == {"test-torch"}
        order: list[int] = []
        done = [thread.submit(order.append, i) for i in range(20)]
        for f in done:
            f.result(timeout=5)
        assert order == list(range(20))
        with pytest.raises(ZeroDivisionError):
            thread.submit(lambda: 1 / 0).result(timeout=5)
        assert thread.submit(sum, [1, 2], start=3).result(timeout=5) == 6  # keyword arguments pass through
    finally:
        thread.shutdown()


def test_shutdown_cancels_what_is_queued_when_asked_and_refuses_new_work():
    thread = TorchThread()
    started, gate = threading.Event(), threading.Event()
    running = thread.submit(lambda: started.set() or gate.wait(5))
    assert started.wait(5)
    queued = thread.submit(lambda: "never")
    thread.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert running.result(timeout=5) is True
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        thread.submit(lambda: None)


@needs_library
def test_an_idle_thread_parks_and_the_next_submission_wakes_it():
    thread = TorchThread()
    thread.park_when_idle = lambda: True
    try:
        for i in range(50):  # each submission lands on a parked thread, or one about to park
            assert thread.submit(lambda n=i: n * 2).result(timeout=5) == i * 2
            time.sleep(0.001 * (i % 3))
        wait_for(lambda: thread.parks >= 1, timeout=5, interval=0.01)
    finally:
        thread.shutdown()  # wakes a parked thread to end it
    assert not thread._thread.is_alive()


@needs_library
def test_a_late_wake_up_with_nothing_queued_parks_the_team_again():
    """A submission's wake-up can come after the thread ran that work and parked: it must not leave the team
    awake (spinning) until the next submission."""
    thread = TorchThread()
    thread.park_when_idle = lambda: True
    try:
        assert thread.submit(lambda: 7).result(timeout=5) == 7
        wait_for(lambda: thread.parks >= 1, timeout=5, interval=0.005)
        parks = thread.parks
        thread._wake()  # as a submission's wake that lost the race with the work it brought
        wait_for(lambda: thread.parks > parks, timeout=5, interval=0.005)
    finally:
        thread.shutdown()
    assert not thread._thread.is_alive()


IDLE_CPU = textwrap.dedent("""
    import os, sys, time, torch
    from daemon.model import native
    from daemon.model.worker import TorchThread
    torch.set_num_threads(2)
    thread = TorchThread()
    thread.park_when_idle = lambda: sys.argv[1] == "park"
    weight, x = torch.randn(1536, 576), torch.randn(1, 576)
    for _ in range(3):  # parallel regions on the thread: its OpenMP team now exists
        thread.submit(native.gemv, x, weight).result()
    time.sleep(0.1)
    before = time.process_time()
    time.sleep(0.5)
    print(time.process_time() - before)
    thread.shutdown()
""")


@pytest.mark.slow  # about 4 s of CPU-time measurement
@needs_library
def test_a_parked_team_does_not_spin_on_the_cores():
    """Idle for half a second after a step: spinning workers burn about that much CPU time, a parked team none."""
    spent = {}
    env = {name: value for name, value in os.environ.items() if not name.startswith(("OMP_", "GOMP_"))}
    for mode in ("park", "spin"):
        done = subprocess.run([sys.executable, "-c", IDLE_CPU, mode], capture_output=True, text=True, timeout=120,
                              env={**env, "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "infinite"})
        assert done.returncode == 0, done.stderr
        spent[mode] = float(done.stdout.split()[-1])
    # a spinning worker burns up to the whole half second (less where other processes hold the cores)
    assert spent["spin"] > 0.05, spent  # the check can fail: spinning workers are seen
    assert spent["park"] < spent["spin"] / 10, spent
