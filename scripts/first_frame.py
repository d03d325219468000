"""Time ``meshtui --connect URL`` from spawn to its first full frame, against a fake daemon on 127.0.0.1.

    .venv/bin/python scripts/first_frame.py [--runs 5] [--console PATH]

The console runs in a 120x40 pseudo-terminal, as an operator would start it. Its first full frame is
the moment the terminal has been sent the Mesh view's row for the head and the footer's bindings (the
footer is the last part Textual paints). One untimed run first warms the disk cache and bytecode; then
each run is printed and the median last, with the CPU time the console had used by then: on a shared
machine the wall time varies with the load, the CPU time less so.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.tui_data import FakeDaemon, served_in_thread  # noqa: E402 - the repository root is on the path only now

MESHTUI = ROOT / ".venv" / "bin" / "meshtui"
ROWS, COLUMNS = 40, 120
# bytecode is written as an installed console's is (this sandbox may say not to), so edits are timed fairly
CONSOLE_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"TERM": "xterm-256color"}
# escape sequences carry no text: drop them so a marker is found whatever styles surround it
ESCAPES = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


def first_frame(console: Path, url: str, config: Path, limit: float = 20.0) -> tuple[float, float]:
    """Wall and CPU seconds from spawning ``console --connect url`` to its first full frame; then it is stopped."""
    markers = [f"◆ {url.removeprefix('http://')}".encode(), b"Add peer"]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    started = time.monotonic()
    process = subprocess.Popen([str(console), "--connect", url, "--config", str(config)],
                               stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env=CONSOLE_ENV)
    os.close(slave)
    output = b""
    try:
        while time.monotonic() - started < limit:
            ready, _, _ = select.select([master], [], [], 0.05)
            if ready:
                try:
                    output += os.read(master, 65536)
                except OSError:  # the console closed the terminal: it has exited
                    break
                if all(marker in ESCAPES.sub(b"", output) for marker in markers):
                    return time.monotonic() - started, cpu_seconds(process.pid)
            elif process.poll() is not None:
                break
        status = process.poll()
        ended = f"no full frame in {limit:g} s" if status is None else f"exit status {status} before a full frame"
        raise SystemExit(f"{console}: {ended}; the terminal got: {ESCAPES.sub(b'', output)[-800:]!r}")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        os.close(master)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a running process has used, all its threads together (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs (default 5)")
    parser.add_argument("--console", type=Path, default=MESHTUI,
                        help="the meshtui to time (default: this checkout's); another checkout's, to compare")
    args = parser.parse_args()

    with served_in_thread(FakeDaemon(0, 30)) as daemon, tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "meshtui.toml"  # absent: the defaults, and nothing of the user's
        first_frame(args.console, daemon.url, config)  # warm-up, not counted
        walls, cpus = [], []
        for run in range(1, args.runs + 1):
            wall, cpu = first_frame(args.console, daemon.url, config)
            walls.append(wall)
            cpus.append(cpu)
            print(f"run {run}: {wall:.3f} s (CPU {cpu:.2f} s)", flush=True)
    print(f"meshtui --connect: first full frame after {statistics.median(walls):.3f} s, CPU "
          f"{statistics.median(cpus):.2f} s (medians of {len(walls)} runs; load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
