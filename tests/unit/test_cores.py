"""The host's cores (``daemon.host``), sharing them among co-located daemons (``daemon.model.cores``),
and activation bytes.

Several :class:`CoreShare` objects in one process stand for several daemons: each
registers its own file, exactly as separate processes do.
"""

from __future__ import annotations

import os

import pytest
import torch

from daemon.host import cpu_name, host_cores
from daemon.model.cores import CoreShare
from daemon.model.tensors import as_sent, to_activation, to_tensor


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_step_takes_the_cores_the_daemons_computing_with_it_leave(tmp_path, keep_threads):
    a = CoreShare(cores=4, folder=tmp_path)
    with a.computing() as threads:
        assert threads == 4 and torch.get_num_threads() == 4  # alone on the host
    b = CoreShare(cores=4, folder=tmp_path)  # a worker started without --peer: counted all the same
    with b.computing() as threads:
        assert threads == 4  # a is idle: b's step takes every core
        a._scanned = float("-inf")  # as if a second had passed: a lists the folder again and finds b
        with a.computing() as threads:
            assert threads == 2 and torch.get_num_threads() == 2 and a.computing_others == 1
    with a.computing() as threads:
        assert threads == 4  # b's step ended: a's next step has the host again
    b.close()
    a._scanned = float("-inf")
    with a.computing():
        assert a.computing_others == 0 and not a._others
    a.close()
    assert not list(tmp_path.iterdir())


def test_three_daemons_computing_on_two_cores_never_go_below_one_thread(tmp_path, keep_threads):
    shares = [CoreShare(cores=2, folder=tmp_path) for _ in range(3)]
    with shares[0].computing(), shares[1].computing(), shares[2].computing() as threads:
        assert threads == 1 and shares[2].computing_others == 2
    for share in shares:
        share.close()


def test_a_daemon_that_dies_mid_step_leaves_no_lock_behind(tmp_path, keep_threads):
    import subprocess
    import sys

    share = CoreShare(cores=2, folder=tmp_path)
    code = ("import sys, time; from pathlib import Path; from daemon.model.cores import CoreShare; "
            "s = CoreShare(cores=2, folder=Path(sys.argv[1])); step = s.computing(); step.__enter__(); "
            "print('in', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "in"
        with share.computing() as threads:
            assert threads == 1  # the child holds its lock: it is computing
    finally:
        child.kill()
        child.wait()
    with share.computing() as threads:
        assert threads == 2  # the kernel released the dead child's lock
    share._scanned = float("-inf")
    with share.computing():
        assert not share._others  # and its file is gone at the next scan
    assert [p.name for p in tmp_path.iterdir()] == [share._path.name]
    share.close()


def test_files_of_daemons_that_died_are_removed(tmp_path, keep_threads):
    dead = tmp_path / "999999999-deadbeef.daemon"  # no such pid
    dead.touch()
    share = CoreShare(cores=2, folder=tmp_path)
    with share.computing() as threads:
        assert threads == 2
    assert not dead.exists()
    share.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_activation_bytes_round_trip_without_extra_copies(dtype):
    hidden = torch.randn(1, 3, 8)
    activation = to_activation(hidden, dtype=dtype)
    assert isinstance(activation.data, memoryview) and len(activation.data) == activation.data.nbytes
    assert len(activation.data) == 3 * 8 * (4 if dtype == "float32" else 2)
    back = to_tensor(activation)
    assert torch.equal(back, as_sent(hidden, wire_dtype=dtype, compute_dtype=torch.float32))
    # what went over the wire is a copy the receiver owns: writing to it leaves the sender's bytes alone
    back.add_(1.0)
    assert torch.equal(to_tensor(activation), as_sent(hidden, wire_dtype=dtype, compute_dtype=torch.float32))


def test_the_cores_folder_is_per_user(monkeypatch):
    from daemon.model.cores import default_folder

    monkeypatch.delenv("MESHNET_CORES_DIR", raising=False)
    assert f"meshnet-{os.getuid()}" in str(default_folder())
    monkeypatch.setenv("MESHNET_CORES_DIR", "/somewhere")
    assert str(default_folder()) == "/somewhere"


def test_host_cores_are_this_process_s_affinity():
    assert 1 <= host_cores() <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert host_cores() == len(os.sched_getaffinity(0))


def test_the_cpu_has_a_name():
    assert cpu_name().strip()
