"""Helpers for tests that start real meshd processes on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from daemon.api.launch import MeshdProcess, free_port, node_url


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
                 port: int | None = None, peer_urls: list[str] = (), variant: str | None = None,
                 dtype: str = "float32") -> None:
        """``variant``: a test-only twist on meshd (see ``tests.support.meshd_variants``). ``dtype``: float32 unless a
        test asks for another, so tokens are compared with the float32 reference of ``tests.conftest``."""
        self.port = port or free_port()
        self.url = node_url("127.0.0.1", self.port)
        self.layers = layers
        args = ["--model", str(model), "--layers", layers, "--port", str(self.port), "--threads", str(threads),
                "--dtype", dtype, *extra]
        for url in [p.url for p in peers] + list(peer_urls):
            args += ["--peer", url]
        self.log_path = (log_dir or Path("/tmp")) / f"meshd-{self.port}.log"
        env = os.environ | (env or {})
        self.token = env.get("MESHNET_API_KEY") or env.get("MESHNET_TOKEN")  # sent on every request this helper makes
        module = "tests.support.meshd_variants" if variant else "daemon.cli"
        self.process = MeshdProcess([variant, *args] if variant else args, module=module, label=f"meshd {layers}",
                                    env=env, log_path=self.log_path)

    @property
    def proc(self) -> subprocess.Popen:
        """The node's current process (a new one after :meth:`restart`), for tests that signal or inspect it."""
        return self.process.popen

    def kill(self) -> None:
        """SIGKILL: the node vanishes mid-whatever, as on a crash or a pulled cable."""
        self.process.kill()

    def restart(self) -> Daemon:
        """Start the same node again on the same port (after :meth:`kill` or :meth:`stop`)."""
        self.process.restart()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> Daemon:
        """Wait until it answers /health; raises (quoting its log) if it exits first or times out."""
        self.process.wait_ready(self.url, timeout)
        return self

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

    def metrics(self) -> str:
        """``GET /metrics``: Prometheus' text format."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            conn.request("GET", "/metrics", headers=headers)
            return conn.getresponse().read().decode()
        finally:
            conn.close()

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
        self.process.stop(signal.SIGINT, grace=10.0)


def start_mesh(model, specs: list[tuple[str, list[str]]], *, log_dir=None, env=None,
               dtype: str = "float32") -> list[Daemon]:
    """Start one node per ``(layers, extra args)``, each knowing all the others; the first is the head."""
    daemons: list[Daemon] = []
    ports = [free_port() for _ in specs]
    urls = [node_url("127.0.0.1", p) for p in ports]
    try:
        for i, ((layers, extra), port) in enumerate(zip(specs, ports)):
            others = urls[:i] + urls[i + 1:]
            daemons.append(Daemon(model, layers, extra=extra, log_dir=log_dir, env=env, port=port, peer_urls=others,
                                  dtype=dtype))
        for d in daemons:
            d.wait_ready()
        for d in daemons:
            d.wait_peers(len(daemons) - 1)
    except BaseException:
        for d in daemons:
            d.stop()
        raise
    return daemons
