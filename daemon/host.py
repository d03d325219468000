"""Facts about the machine this process runs on: the cores it may use and the CPU's name; and handing the C
heap's free memory back to it.

Standard library only, and nothing of the daemon: the config, the model code and the bench all
read these, so they live below every layer.
"""

from __future__ import annotations

import ctypes
import os
import platform


def host_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_name() -> str:
    """This host's CPU model as the kernel names it (``/proc/cpuinfo``), else what Python knows of it."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere). A freed
    tensor of a few MiB stays in glibc's heap, where a new one of the same size does not fit (it asks for
    alignment on top): a node laying out or fusing its weights anew would otherwise peak well above them."""
    if LIBC is not None:
        LIBC.malloc_trim(0)


def _load_libc():
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc: nothing to trim, nothing lost
        return None


LIBC = _load_libc()  # the C library (glibc's malloc_trim, madvise), or None where it cannot be had
