"""Start ``meshd`` as a child process, find it a free port, and wait until it serves.

One launcher for everything that runs daemons on this machine: the console's local mesh, the
tests' ``Daemon`` helper and ``meshd bench``. Standard library only (no aiohttp, no torch): the
console imports this and must start fast.

A child is ``python -m daemon.cli ARGS`` (or another module of this project, such as a test-only
variant of meshd) with ``PYTHONUNBUFFERED=1``, its stdin closed and stdout and stderr merged. Its
output goes straight to a log file, or line by line through a reader thread to a callback (and
the log file, if any). Either way the last lines are at hand to quote when it fails.

On Linux every child gets a parent-death signal (``PR_SET_PDEATHSIG``): it is sent SIGTERM even
when its parent is killed with SIGKILL, so nothing is left behind. The kernel sends that signal
when the *thread* that started the child ends, so start children from a thread that outlives them
(the main thread, or an event loop running in it). Each child also gets its own session, so the
terminal's Ctrl+C and hang-up reach the parent alone, which then stops its children in order.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

LOOPBACK = "127.0.0.1"
# what meshd imports beyond the console's packages: the `node` extra (a console-only install lacks them all)
NODE_PACKAGES = ("torch", "transformers", "safetensors", "gguf", "prometheus_client", "pythonjsonlogger", "httptools")
NODE_INSTALL = 'pip install "meshnet[node]"'
STOP_GRACE_S = 5.0
TAIL_LINES = 40  # lines of output kept in memory to quote when a child fails
_LOG_TAIL_BYTES = 64 * 1024  # read from the end of a log file to find its last lines


def free_port(host: str = LOOPBACK) -> int:
    """A port nobody listens on right now on ``host`` (the OS picks it), and not one this process handed out before.

    The OS may pick a port again as soon as the socket that held it closes, and a child told a port takes
    seconds to bind it: two nodes started one after the other could be told the same port, the second fail to
    bind, and a wait for it be answered by the first. So a port handed out once is not handed out again.
    """
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` different ports nobody listens on right now, none handed out before by this process: the sockets
    stay bound until all are chosen, so the OS cannot pick one of them twice."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            s = held.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
            s.bind((host, 0))
            port = s.getsockname()[1]
            with _handed_out_lock:
                if port in _handed_out:
                    continue  # held bound until the end, so the OS picks another
                _handed_out.add(port)
            ports.append(port)
        return ports


_handed_out: set[int] = set()  # every port free_port(s) returned in this process
_handed_out_lock = threading.Lock()


def node_url(host: str, port: int) -> str:
    """The URL that reaches a node bound to ``host``: a wildcard address means loopback, and an IPv6
    address goes in brackets (``node_url("::1", 7070) == "http://[::1]:7070"``)."""
    host = LOOPBACK if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def missing_node_packages() -> list[str]:
    """The packages a node needs that this install lacks: all of them on a console-only install."""
    return [name for name in NODE_PACKAGES if importlib.util.find_spec(name) is None]


def console_only(missing: list[str]) -> str:
    """Why this install cannot run a node, for an error message."""
    lacks = missing[0] if len(missing) == 1 else f"{missing[0]} and {len(missing) - 1} more of the node's packages"
    return f"this is a console-only install (no {lacks})"


def describe_returncode(code: int | None) -> str:
    """``"running"``, ``"exited with code 2"`` or ``"killed by SIGKILL"``, from a ``Popen.returncode``."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class MeshdExited(RuntimeError):
    """A child ended before it was ready; the message quotes its last output."""


class MeshdProcess:
    """One child ``python -m module ARGS``, started at once; :meth:`stop` (idempotent) ends it.

    ``env``: the child's whole environment (default: this process's). ``log_path``: a file that
    receives its output, truncated at the first start and appended to by :meth:`restart`.
    ``on_line(line)`` and ``on_exit(returncode)`` are called from a reader thread, for each line and
    once the output has ended and the child has exited; without them the output goes straight to
    ``log_path`` (complete the moment the child exits), or, with no ``log_path`` either, to memory.
    """

    def __init__(self, args: Sequence[str], *, module: str = "daemon.cli", label: str = "meshd",
                 env: Mapping[str, str] | None = None, log_path: Path | str | None = None,
                 on_line: Callable[[str], None] | None = None,
                 on_exit: Callable[[int], None] | None = None) -> None:
        self.argv = [sys.executable, "-m", module, *args]
        self.label = label
        self.env = dict(os.environ if env is None else env) | {"PYTHONUNBUFFERED": "1"}
        self.log_path = Path(log_path) if log_path is not None else None
        self._on_line = on_line
        self._on_exit = on_exit
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._reader: threading.Thread | None = None
        self.popen = self._start(restarted=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """None while it runs; then its exit code, or minus the signal that ended it."""
        return self.popen.poll()

    def poll(self) -> int | None:
        """The same as :attr:`returncode`, as ``Popen.poll`` spells it."""
        return self.popen.poll()

    def wait_ready(self, url: str, timeout: float = 180.0) -> None:
        """Block until ``url/health`` answers 200. Raises :class:`MeshdExited` if the child ends first
        and :class:`TimeoutError` after ``timeout`` seconds, each quoting its last output."""
        deadline = time.monotonic() + timeout
        while True:
            if self.poll() is not None:
                raise MeshdExited(f"{self.label} {describe_returncode(self.returncode)} before it was ready:\n"
                                  f"{self.last_output()}{self._log_note()}")
            if _answers_health(url):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label} did not answer {url}/health within {timeout:.0f} s; "
                                   f"its last output:\n{self.last_output()}{self._log_note()}")
            time.sleep(0.2)

    def last_output(self, lines: int = 12) -> str:
        """The last lines it printed, indented to quote under a message."""
        if self._reader is not None:
            if self.poll() is not None:
                self._reader.join(timeout=2.0)  # let the reader take in what the child wrote last
            tail = list(self._tail)
        else:
            tail = self._log_tail()
        return "\n".join(f"  {line}" for line in tail[-lines:]) or "  (no output)"

    def stop(self, signum: int = signal.SIGTERM, grace: float = STOP_GRACE_S) -> None:
        """Send ``signum``, wait up to ``grace`` seconds, then SIGKILL. Nothing happens if it has ended."""
        stop_all([self], signum=signum, grace=grace)

    def kill(self) -> None:
        """SIGKILL and reap it: it vanishes mid-whatever, as on a crash or a pulled cable."""
        self.popen.kill()
        self.popen.wait()

    def restart(self) -> MeshdProcess:
        """Stop it if it still runs, then start the same command line again (so, the same port)."""
        self.stop()
        if self._reader is not None:
            self._reader.join(timeout=2.0)  # the old reader closes the log before the new one opens it
        self.popen = self._start(restarted=True)
        return self

    def _start(self, *, restarted: bool) -> subprocess.Popen:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._on_line is None and self._on_exit is None and self.log_path is not None:
            with open(self.log_path, "ab" if restarted else "wb") as log:
                if restarted:
                    log.write(b"\n----- restarted -----\n")
                    log.flush()
                return self._popen(stdout=log)  # the child holds its own copy of the file
        log = open(self.log_path, "a" if restarted else "w", encoding="utf-8") if self.log_path else None
        if log and restarted:
            log.write("\n----- restarted -----\n")
        self._tail.clear()
        try:
            popen = self._popen(stdout=subprocess.PIPE)
        except BaseException:
            if log:
                log.close()
            raise
        self._reader = threading.Thread(target=self._read, args=(popen, log), name=f"{self.label} output",
                                        daemon=True)
        self._reader.start()
        return popen

    def _popen(self, *, stdout) -> subprocess.Popen:
        return subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT,
                                env=self.env, preexec_fn=_die_with_parent(), start_new_session=True)

    def _read(self, popen: subprocess.Popen, log: TextIO | None) -> None:
        """Drain the child's output whatever the caller is doing, so the pipe never fills."""
        try:
            for raw in popen.stdout:
                line = _last_state(raw.decode("utf-8", "replace"))
                self._tail.append(line)
                if log:
                    log.write(line + "\n")
                    log.flush()
                if self._on_line is not None:
                    self._on_line(line)
        finally:
            popen.stdout.close()
            if log:
                log.close()
        code = popen.wait()
        if self._on_exit is not None:
            self._on_exit(code)

    def _log_tail(self) -> list[str]:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return []
        # split on newlines only: a carriage return redraws a line, it does not end one
        return [_last_state(line) for line in text.rstrip("\n").split("\n") if line]

    def _log_note(self) -> str:
        return f"\n  (all of it in {self.log_path})" if self.log_path else ""


def stop_all(processes: Iterable[MeshdProcess], *, signum: int = signal.SIGTERM,
             grace: float = STOP_GRACE_S) -> None:
    """Send every running child ``signum`` at once, give them ``grace`` seconds together, then SIGKILL
    what is left. One signal each: meshd takes a second SIGTERM or SIGINT as "stop now, skip draining"."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        try:
            process.popen.send_signal(signum)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for process in running:
        try:
            process.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()


def _last_state(line: str) -> str:
    """A progress bar redraws itself with carriage returns: its last state is the line."""
    return line.rstrip("\r\n").rsplit("\r", 1)[-1]


def _answers_health(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url/health`` answers 200 now; http.client, not urllib, so no proxy setting interferes."""
    parts = urllib.parse.urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=timeout)
    try:
        connection.request("GET", parts.path.rstrip("/") + "/health")
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGTERM the child when its parent dies (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded before fork: only a call happens after it
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    parent = os.getpid()

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody will stop us
            os._exit(1)

    return preexec
