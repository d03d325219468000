"""The meshd launcher (``daemon.api.launch``): ports, URLs, and children that print, fail, serve, linger or outlive us.

The children are this very file run as ``python -m tests.mesh.test_launch MODE ...`` (see the bottom), so
each test knows exactly what its child does.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from daemon.api import normalize_url
from daemon.api.launch import (
    MeshdExited,
    MeshdProcess,
    describe_returncode,
    free_port,
    node_url,
    stop_all,
)
from tests.support.watch import wait_for

REPO = Path(__file__).resolve().parents[2]
CHILD_ENV = os.environ | {"PYTHONPATH": str(REPO)}


def child(*args: str, env: dict[str, str] = CHILD_ENV, **kwargs) -> MeshdProcess:
    """This file as a child process in mode ``args``."""
    return MeshdProcess(list(args), module="tests.mesh.test_launch", label="test child", env=env, **kwargs)


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie nobody has reaped yet counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# -- ports, URLs, cores ----------------------------------------------------------------------------

def test_a_free_port_can_be_listened_on():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()


def test_a_free_ipv6_port_can_be_listened_on():
    try:
        port = free_port("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with socket.socket(socket.AF_INET6) as server:
        server.bind(("::1", port))
        server.listen()


def test_a_port_handed_out_once_is_not_handed_out_again_though_the_os_picks_it_again(monkeypatch):
    """Nodes started one after the other bind seconds after they are told their ports: the OS may pick a port it
    picked a moment ago, and the second node would fail to bind while a wait for it is answered by the first."""
    import daemon.api.launch as launch

    picks = iter([41001, 41001, 41002, 41001, 41002, 41003, 41004])

    class OsPicks:
        def __init__(self, *_):
            self.port = None

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def bind(self, _address):
            self.port = next(picks)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launch.socket, "socket", OsPicks)
    monkeypatch.setattr(launch, "_handed_out", set())
    assert [free_port(), free_port()] == [41001, 41002]
    assert launch.free_ports(2) == [41003, 41004]


@pytest.mark.parametrize("host, url", [
    ("127.0.0.1", "http://127.0.0.1:7070"),
    ("0.0.0.0", "http://127.0.0.1:7070"),  # a wildcard is reached on loopback
    ("", "http://127.0.0.1:7070"),
    ("::", "http://[::1]:7070"),
    ("::1", "http://[::1]:7070"),
    ("fe80::2", "http://[fe80::2]:7070"),
    ("node-b", "http://node-b:7070"),
])
def test_node_urls(host, url):
    assert node_url(host, 7070) == url


@pytest.mark.parametrize("given, url", [
    ("127.0.0.1:7071", "http://127.0.0.1:7071"),
    ("  http://10.0.0.2:7071/ ", "http://10.0.0.2:7071"),
    ("https://mesh.example:443//", "https://mesh.example:443"),
    ("[::1]:7072", "http://[::1]:7072"),
])
def test_normalize_url(given, url):
    assert normalize_url(given) == url


@pytest.mark.parametrize("given", ["", "   ", "/"])
def test_normalize_url_refuses_an_empty_address(given):
    with pytest.raises(ValueError, match="empty address"):
        normalize_url(given)


@pytest.mark.parametrize("code, text", [
    (None, "running"), (0, "exited with code 0"), (2, "exited with code 2"),
    (-signal.SIGKILL, "killed by SIGKILL"), (-200, "killed by signal 200"),
])
def test_describe_returncode(code, text):
    assert describe_returncode(code) == text


# -- children that print and exit ------------------------------------------------------------------

def test_a_child_s_lines_reach_the_callback_and_its_exit_is_reported_with_its_tail():
    lines: list[str] = []
    exits: list[int] = []
    process = child("lines", "30", "3", on_line=lines.append, on_exit=exits.append)
    wait_for(lambda: exits)
    assert exits == [3] and process.returncode == 3 and process.poll() == 3
    assert lines == [f"line {i}" for i in range(30)] + ["100%"]  # a redrawn progress bar: its last state
    assert process.last_output(3) == "  line 28\n  line 29\n  100%"
    with pytest.raises(MeshdExited) as failure:
        process.wait_ready(node_url("127.0.0.1", free_port()), timeout=30)
    assert "test child exited with code 3 before it was ready" in str(failure.value)
    assert "line 29" in str(failure.value) and "line 17" not in str(failure.value)


def test_output_goes_straight_to_the_log_file_and_a_restart_appends_to_it(tmp_path):
    log = tmp_path / "logs" / "child.log"
    process = child("lines", "5", "0", log_path=log)
    assert process.popen.wait(30) == 0
    assert log.read_text().splitlines()[:5] == [f"line {i}" for i in range(5)]
    assert process.last_output(2) == "  line 4\n  100%"  # read back from the file
    first = process.pid
    process.restart()
    assert process.popen.wait(30) == 0 and process.pid != first
    text = log.read_text()
    assert text.count("line 4") == 2 and "----- restarted -----" in text
    with pytest.raises(MeshdExited, match=f"(?s)exited with code 0.*all of it in {log}"):
        process.wait_ready(node_url("127.0.0.1", free_port()), timeout=30)


def test_lines_go_to_the_callback_and_the_log_file_together(tmp_path):
    lines: list[str] = []
    process = child("lines", "3", "0", log_path=tmp_path / "child.log", on_line=lines.append)
    process.popen.wait(30)
    wait_for(lambda: len(lines) == 4)
    process.last_output()  # waits for the reader, which closes the log
    assert (tmp_path / "child.log").read_text() == "line 0\nline 1\nline 2\n100%\n"


def test_the_child_gets_the_given_environment_and_unbuffered_output():
    lines: list[str] = []
    process = child("env", "MESHNET_LAUNCH_TEST", "PYTHONUNBUFFERED", on_line=lines.append,
                    env=CHILD_ENV | {"MESHNET_LAUNCH_TEST": "given"})
    process.popen.wait(30)
    process.last_output()
    assert lines == ["MESHNET_LAUNCH_TEST=given", "PYTHONUNBUFFERED=1"]


# -- children that serve, and children that will not stop -----------------------------------------

def test_wait_ready_returns_once_health_answers_and_stop_ends_the_server():
    port = free_port()
    process = child("serve", str(port))
    try:
        process.wait_ready(node_url("127.0.0.1", port), timeout=60)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        process.stop()
    assert process.returncode == -signal.SIGTERM
    process.stop()  # twice is fine
    assert process.returncode == -signal.SIGTERM


def test_wait_ready_times_out_with_the_child_s_last_output():
    process = child("ignore-term")
    try:
        wait_for(lambda: "ignoring SIGTERM" in process.last_output())
        with pytest.raises(TimeoutError, match=r"(?s)did not answer .*/health within 1 s.*ignoring SIGTERM"):
            process.wait_ready(node_url("127.0.0.1", free_port()), timeout=1)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL


def test_stop_escalates_to_sigkill_when_the_signal_is_ignored():
    process = child("ignore-term")
    wait_for(lambda: "ignoring SIGTERM" in process.last_output())  # the handler is in place
    started = time.monotonic()
    process.stop(grace=1.0)
    took = time.monotonic() - started
    assert process.returncode == -signal.SIGKILL
    assert 1.0 <= took < 10.0


def test_stop_all_gives_every_child_one_signal_and_one_grace_together():
    stubborn = [child("ignore-term") for _ in range(2)]
    polite = child("serve", str(free_port()))
    for process in stubborn:
        wait_for(lambda process=process: "ignoring SIGTERM" in process.last_output())
    started = time.monotonic()
    stop_all([*stubborn, polite], grace=1.0)
    assert time.monotonic() - started < 1.0 * len(stubborn) + 5.0  # shared, not 1 s per child in a row
    assert [p.returncode for p in stubborn] == [-signal.SIGKILL, -signal.SIGKILL]
    assert polite.returncode == -signal.SIGTERM


def test_the_default_module_is_meshd():
    process = MeshdProcess(["--version"])
    assert process.argv[:3] == [sys.executable, "-m", "daemon.cli"]
    assert process.popen.wait(60) == 0
    assert "meshd " in process.last_output()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent_even_on_sigkill():
    parent = subprocess.Popen([sys.executable, "-m", "tests.mesh.test_launch", "parent"], stdout=subprocess.PIPE,
                              text=True, env=CHILD_ENV, cwd=REPO)
    try:
        pid = int(parent.stdout.readline())
        assert alive(pid)
        parent.kill()  # no atexit, no finally: only the parent-death signal is left
        parent.wait()
        wait_for(lambda: not alive(pid), timeout=15)
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()


# -- the children ----------------------------------------------------------------------------------

class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # the name http.server calls
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _child(mode: str, *args: str) -> int:
    if mode == "lines":  # print N lines and a progress bar redrawn with a carriage return, exit CODE
        for i in range(int(args[0])):
            print(f"line {i}")
        print("50%\r100%")
        return int(args[1])
    if mode == "env":
        for name in args:
            print(f"{name}={os.environ.get(name)}")
        return 0
    if mode == "serve":  # /health on 127.0.0.1:PORT until a signal ends it
        http.server.HTTPServer(("127.0.0.1", int(args[0])), _Health).serve_forever()
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM")
        time.sleep(120)
    if mode == "parent":  # start a child, say its pid, wait to be killed
        process = child("sleep")
        print(process.pid, flush=True)
        threading.Event().wait(120)
    if mode == "sleep":
        time.sleep(120)
    return 1


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:]))
