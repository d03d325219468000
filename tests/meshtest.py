"""Helpers for tests that start real meshd processes on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 300.0,
              token: str | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


class Daemon:
    """One ``meshd`` process on 127.0.0.1, stopped by :meth:`stop`."""

    def __init__(self, model: Path | str, layers: str, *, peers: list[Daemon] = (), extra: list[str] = (),
                 env: dict | None = None, threads: int = 1, log_dir: Path | None = None,
                 port: int | None = None, peer_urls: list[str] = (), variant: str | None = None) -> None:
        """``variant``: a test-only twist on meshd (see ``tests.meshd_variants``)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.layers = layers
        program = ["tests.meshd_variants", variant] if variant else ["daemon.cli"]
        argv = [sys.executable, "-m", *program, "--model", str(model), "--layers", layers,
                "--port", str(self.port), "--threads", str(threads), *extra]
        for url in [p.url for p in peers] + list(peer_urls):
            argv += ["--peer", url]
        self.log_path = (log_dir or Path("/tmp")) / f"meshd-{self.port}.log"
        self._argv, self._env = argv, os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {})
        self.token = self._env.get("MESHNET_TOKEN")  # sent on every request this helper makes
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=self._env)

    def kill(self) -> None:
        """SIGKILL: the node vanishes mid-whatever, as on a crash or a pulled cable."""
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> Daemon:
        """Start the same node again on the same port (after :meth:`kill` or :meth:`stop`)."""
        self._log.write(b"\n----- restarted -----\n")
        self._log.flush()
        self.proc = subprocess.Popen(self._argv, stdout=self._log, stderr=subprocess.STDOUT, env=self._env)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> Daemon:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"meshd {self.layers} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status, _ = http_json("GET", self.url + "/health", timeout=2)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"meshd {self.layers} not ready after {timeout} s:\n{self.log()}")

    def wait_peers(self, count: int, timeout: float = 30.0) -> None:
        """Wait until this node sees ``count`` peers up (peers are polled every 2 s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _, status = http_json("GET", self.url + "/v1/status", token=self.token)
            if sum(p["up"] for p in status["peers"]) >= count:
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} sees fewer than {count} peers up: {status['peers']}")

    def get(self, path: str) -> dict:
        status, body = http_json("GET", self.url + path, token=self.token)
        assert status == 200, (status, body)
        return body

    def chat(self, body: dict, timeout: float = 600.0) -> tuple[int, dict]:
        return http_json("POST", self.url + "/v1/chat/completions", body, timeout=timeout, token=self.token)

    def stream(self, body: dict, timeout: float = 600.0) -> Iterator[dict]:
        """POST a streaming chat request and yield each server-sent event's JSON as it arrives."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"}
            if self.token:
                headers["Authorization"] = f"Bearer {self.token}"
            conn.request("POST", "/v1/chat/completions", json.dumps(body | {"stream": True}), headers)
            resp = conn.getresponse()
            assert resp.status == 200, (resp.status, resp.read())
            while line := resp.readline():
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    return
                yield json.loads(line[len(b"data: "):])
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_mesh(model, specs: list[tuple[str, list[str]]], *, log_dir=None, env=None) -> list[Daemon]:
    """Start one node per ``(layers, extra args)``, each knowing all the others; the first is the head."""
    daemons: list[Daemon] = []
    ports = [free_port() for _ in specs]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for i, ((layers, extra), port) in enumerate(zip(specs, ports)):
            others = urls[:i] + urls[i + 1:]
            daemons.append(Daemon(model, layers, extra=extra, log_dir=log_dir, env=env, port=port, peer_urls=others))
        for d in daemons:
            d.wait_ready()
        for d in daemons:
            d.wait_peers(len(daemons) - 1)
    except BaseException:
        for d in daemons:
            d.stop()
        raise
    return daemons
