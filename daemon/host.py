"""Facts about the machine this process runs on: the cores it may use and the CPU's name.

Standard library only, and nothing of the daemon: the config, the model code and the bench all
read these, so they live below every layer.
"""

from __future__ import annotations

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
