"""meshd on the command line: bad models and bad options end with a message, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def meshd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("model, expected", [
    ("/no/such/model", "no such file"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "hub"),
])
def test_a_model_that_cannot_be_had_is_a_clear_error(model, expected):
    result = meshd("--model", model, "--port", "1")
    assert result.returncode == 1
    assert "meshd: error:" in result.stderr and expected in result.stderr.lower()
    assert "Traceback" not in result.stderr


def test_layers_outside_the_model_are_refused(tiny_model):
    result = meshd("--model", str(tiny_model("llama")), "--layers", "2-9")
    assert result.returncode == 2
    assert "--layers" in result.stderr and "last layer 3" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_environment_value_names_the_variable(tmp_path):
    result = subprocess.run([sys.executable, "-m", "daemon.cli"], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "MESHNET_PORT": "seventy", "HOME": str(tmp_path)})
    assert result.returncode == 2 and "MESHNET_PORT" in result.stderr


def test_a_busy_port_is_a_clear_error(tiny_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = meshd("--model", str(tiny_model("llama")), "--port", str(port))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_meshd_runs_on_uvloop_unless_told_otherwise(monkeypatch):
    import uvloop

    from daemon.cli import _loop_factory

    monkeypatch.delenv("MESHNET_EVENT_LOOP", raising=False)
    assert _loop_factory() is uvloop.new_event_loop
    monkeypatch.setenv("MESHNET_EVENT_LOOP", "asyncio")
    assert _loop_factory() is None  # asyncio's own loop, to compare the two
