"""Large temporaries while a node times its kernels (:func:`daemon.host.large_allocations_mapped`): freed, they go
back to the system at once rather than staying in glibc's heap as holes the next one does not fit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from daemon import host

ROOT = Path(__file__).resolve().parents[2]  # the repository: the child imports daemon from it, wherever pytest runs

CHURN = textwrap.dedent("""
    import ctypes, sys
    from daemon.host import large_allocations_mapped, proc_status_bytes

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

    def churn():
        libc.free(libc.malloc(30 << 20))  # a large block freed: glibc's sliding threshold rises to it
        kept = []
        for mib in range(2, 26):  # temporaries each larger than the last, a small live block after each
            block = libc.malloc(mib << 20)
            libc.memset(block, 1, mib << 20)
            kept.append(libc.malloc(64 << 10))
            libc.memset(kept[-1], 1, 64 << 10)
            libc.free(block)
        return proc_status_bytes("VmRSS")["VmRSS"]

    before = proc_status_bytes("VmRSS")["VmRSS"]
    if sys.argv[1] == "mapped":
        with large_allocations_mapped():
            during = churn()
    else:
        during = churn()
    print((during - before) >> 20)
""")


def kept_mib(mode: str) -> int:
    """MiB of resident memory 324 MiB of freed temporaries left behind in a fresh process."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # no MALLOC_* settings of the caller's
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, timeout=60, env=env,
                          check=True)
    return int(done.stdout.strip())


@pytest.mark.skipif(host.LIBC is None or not hasattr(host.LIBC, "mallopt"), reason="glibc only")
def test_freed_large_temporaries_leave_the_resident_set_while_weights_load():
    assert kept_mib("heap") >= 16  # the pattern leaves holes in glibc's heap by default
    assert kept_mib("mapped") <= 4
