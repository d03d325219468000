"""Sharing a host's cores among co-located daemons (``daemon.model.cores``), and activation bytes.

Several :class:`CoreShare` objects in one process stand for several daemons: each
registers its own file, exactly as separate processes do.
"""

from __future__ import annotations

import os

import pytest
import torch

from daemon.model.cores import CoreShare
from daemon.model.tensors import as_sent, to_activation, to_tensor


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_daemons_share_the_cores_fairly_and_follow_daemons_that_come_and_go(tmp_path, keep_threads):
    a = CoreShare(cores=4, folder=tmp_path)
    assert a.adjust() == 4 and torch.get_num_threads() == 4  # alone on the host
    b = CoreShare(cores=4, folder=tmp_path)  # a worker started without --peer: counted all the same
    c = CoreShare(cores=4, folder=tmp_path)
    assert b.adjust() == 1 and torch.get_num_threads() == 1  # 4 cores, 3 daemons
    assert a.adjust() == 4  # a lists the folder at most once a second
    a._scanned = float("-inf")  # as if a second had passed
    assert a.adjust() == 1  # idle or not, the others hold their share
    c.close()
    b.close()
    a._scanned = float("-inf")
    assert a.adjust() == 4
    a.close()
    assert not list(tmp_path.iterdir())


def test_three_daemons_on_two_cores_never_go_below_one_thread(tmp_path, keep_threads):
    shares = [CoreShare(cores=2, folder=tmp_path) for _ in range(3)]
    assert [share.adjust() for share in shares] == [1, 1, 1]


def test_files_of_daemons_that_died_are_removed(tmp_path, keep_threads):
    dead = tmp_path / "999999999-deadbeef.daemon"  # no such pid
    dead.touch()
    share = CoreShare(cores=2, folder=tmp_path)
    assert share.adjust() == 2
    assert not dead.exists()


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
