"""Sharing one host's cores among the meshd daemons on it, step by step.

A two-node mesh on one host computes one step at a time while it serves one
stream (the head's layers, then the tail's), and both at once while it serves
several. The first wants every core for whichever node is computing; the second
must not run two full OpenMP teams on the same cores, which slows every daemon
3-5x. So each daemon registers a file in a per-user folder (``/tmp/meshnet-UID/
cores``) for as long as it lives, holds an exclusive ``flock`` on it while a step
computes, and before each step counts the other daemons holding theirs: its torch
threads are ``cores // daemons computing now``. Files of processes that died are
removed; a dead process's lock is released by the kernel.

Two daemons starting a step at the same moment each take their lock before they
look, so at least one of them sees the other: at worst a step runs with a share
too many threads, never both with every core.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from daemon.host import host_cores

RESCAN_SECONDS = 1.0  # how often the folder is listed for daemons that came or went


def default_folder() -> Path:
    """Where the daemons of this user on this host meet (``MESHNET_CORES_DIR`` overrides)."""
    configured = os.environ.get("MESHNET_CORES_DIR")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"meshnet-{os.getuid()}" / "cores"


class CoreShare:
    """This daemon's torch threads: the host's cores shared among the daemons computing at each step.

    Used from the node's one torch worker thread, around each step (:meth:`computing`).
    """

    def __init__(self, *, cores: int | None = None, folder: Path | None = None) -> None:
        self.cores = cores or host_cores()
        self.folder = folder or default_folder()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._path = self.folder / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.daemon"
        self._fd = os.open(self._path, os.O_CREAT | os.O_RDWR, 0o600)
        self._others: dict[str, int] = {}  # file name -> an open descriptor to test its lock with
        self._lock = threading.Lock()  # the torch thread rescans, the event loop may ask who computes
        self._scanned = float("-inf")
        self.threads = 0  # what torch runs with now; 0 until the first step
        self.computing_others = 0  # other daemons computing when this one's last step began

    def close(self) -> None:
        """Leave the folder: the other daemons stop counting this one at their next scan."""
        with self._lock:
            for fd in [self._fd, *self._others.values()]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._others.clear()
        with contextlib.suppress(OSError):
            self._path.unlink()

    @contextlib.contextmanager
    def computing(self) -> Iterator[int]:
        """Mark this daemon computing for the ``with`` block, with torch set to its share: yields the threads."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # taken before looking at the others, see the module's note
        try:
            yield self.adjust()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def adjust(self) -> int:
        """Set torch's threads to this daemon's share of the cores among the daemons computing now."""
        now = time.monotonic()
        if now - self._scanned >= RESCAN_SECONDS:
            self._scanned = now
            self._rescan()
        self.computing_others = self.others_computing()
        threads = max(1, self.cores // (1 + self.computing_others))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads

    def shared(self) -> bool:
        """Whether another daemon lives on this host (as of the latest scan)."""
        return bool(self._others)

    def others_computing(self) -> int:
        """How many other daemons on this host are computing a step now."""
        with self._lock:
            return sum(_locked(fd) for fd in self._others.values())

    def _rescan(self) -> None:
        try:
            names = {n for n in os.listdir(self.folder) if n.endswith(".daemon") and n != self._path.name}
        except OSError:
            names = set()
        live = {name for name in names if _alive(name)}
        with self._lock:
            self._update_others(names, live)

    def _update_others(self, names: set[str], live: set[str]) -> None:
        for name in names - live:
            with contextlib.suppress(OSError):
                os.unlink(self.folder / name)  # left by a daemon that died
        for name in set(self._others) - live:
            with contextlib.suppress(OSError):
                os.close(self._others.pop(name))
        for name in live - set(self._others):
            with contextlib.suppress(OSError):
                self._others[name] = os.open(self.folder / name, os.O_RDONLY)

def _locked(fd: int) -> bool:
    """Whether another daemon holds its file's lock (is computing): a shared lock cannot be had then."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _alive(name: str) -> bool:
    try:
        os.kill(int(name.split("-", 1)[0]), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True
    return True
