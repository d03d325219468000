"""Sharing one host's cores among the meshd daemons on it.

Several daemons on one host that each take every core oversubscribe it as soon
as they compute at once (overlapping generations), and OpenMP threads then slow
every daemon 3-5x. Counting only the peers a daemon was told about on loopback is
not enough: a worker started without ``--peer`` next to its head would take every
core. So every daemon registers a file in a per-user folder (``/tmp/meshnet-UID/
cores``) for as long as it lives, and before each step sets its torch threads to
``cores // daemons registered``: a fair share that follows daemons as they come
and go (files of processes that died are removed).

Why not lend idle daemons' cores to the one computing (a step runs on one node
at a time)? Measured on a 2-core virtual machine, two threads per decode step
were no faster than one (the step is memory-bound and waking OpenMP workers
costs), and slower whenever other tenants kept the second core busy.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import uuid
from pathlib import Path

import torch

from daemon.api.launch import host_cores

RESCAN_SECONDS = 1.0  # how often the folder is listed for daemons that came or went


def default_folder() -> Path:
    """Where the daemons of this user on this host meet (``MESHNET_CORES_DIR`` overrides)."""
    configured = os.environ.get("MESHNET_CORES_DIR")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"meshnet-{os.getuid()}" / "cores"


class CoreShare:
    """This daemon's torch threads: the host's cores shared fairly among the daemons registered on it.

    Used from the node's one torch worker thread, before each step.
    """

    def __init__(self, *, cores: int | None = None, folder: Path | None = None) -> None:
        self.cores = cores or host_cores()
        self.folder = folder or default_folder()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._path = self.folder / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.daemon"
        self._path.touch(mode=0o600)
        self.others = 0  # other daemons registered here at the last scan
        self._scanned = float("-inf")
        self.threads = 0  # what torch runs with now; 0 until the first step

    def close(self) -> None:
        """Leave the folder: the other daemons take this one's share at their next scan."""
        with contextlib.suppress(OSError):
            self._path.unlink()

    def adjust(self) -> int:
        """Set torch's threads to this daemon's share (the folder is listed at most once a second)."""
        now = time.monotonic()
        if now - self._scanned >= RESCAN_SECONDS:
            self._scanned = now
            self.others = self._count_others()
        threads = max(1, self.cores // (1 + self.others))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads

    def _count_others(self) -> int:
        try:
            names = [n for n in os.listdir(self.folder) if n.endswith(".daemon") and n != self._path.name]
        except OSError:
            return 0
        alive = 0
        for name in names:
            if _alive(name):
                alive += 1
            else:
                with contextlib.suppress(OSError):
                    os.unlink(self.folder / name)  # left by a daemon that died
        return alive


def _alive(name: str) -> bool:
    try:
        os.kill(int(name.split("-", 1)[0]), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True
    return True
