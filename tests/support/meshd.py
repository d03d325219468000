"""The tests' one way to start ``meshd``: a node as a process on 127.0.0.1 (:class:`Daemon`), a mesh of them
(:func:`start_mesh`), or the command run to its end (:func:`run_meshd`, or :func:`run_meshd_in_process` for one
that refuses to start)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from daemon.api.launch import MeshdProcess, free_port, free_ports, node_url
from tests.support.http_client import bearer, http_json, send, stream_events


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
        if "--ssl-certfile" in extra:  # it serves HTTPS: this helper's own requests go over TLS too
            self.url = self.url.replace("http://", "https://", 1)
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
        """Everything the node has written to stdout and stderr so far."""
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
        """``GET path`` as JSON; it must answer 200."""
        status, body = http_json("GET", self.url + path, token=self.token)
        assert status == 200, (status, body)
        return body

    def metrics(self) -> str:
        """``GET /metrics``: Prometheus' text format."""
        return send("GET", self.url + "/metrics", headers=bearer(self.token), timeout=10).body.decode()

    def chat(self, body: dict, timeout: float = 600.0) -> tuple[int, dict]:
        """``POST /v1/chat/completions``: (status, JSON body)."""
        return http_json("POST", self.url + "/v1/chat/completions", body, timeout=timeout, token=self.token)

    def stream(self, body: dict, timeout: float = 600.0) -> Iterator[dict]:
        """POST a streaming chat request and yield each server-sent event's JSON as it arrives."""
        return stream_events(self.url + "/v1/chat/completions", body | {"stream": True}, bearer(self.token), timeout)

    def stop(self) -> None:
        """SIGINT, as Ctrl-C would: the node drains and exits (killed after a grace of 10 s)."""
        self.process.stop(signal.SIGINT, grace=10.0)


def start_mesh(model, specs: Sequence[tuple], *, peers: Sequence[Sequence[int]] | None = None, log_dir=None,
               env=None, dtype: str = "float32") -> list[Daemon]:
    """Start one node per spec, ``(layers, extra args)`` or ``(layers, extra args, variant)``; the first is the head.

    Each node is told of every other one, or, with ``peers``, of the nodes at the indexes ``peers[i]`` lists. Returns
    once every node answers, sees as many peers up as it was told of, and the head sees all the others (some
    perhaps learned from its peers); stops them all if one fails.
    """
    daemons: list[Daemon] = []
    ports = free_ports(len(specs))  # distinct: a node told of its own port would see itself, not its peer
    urls = [node_url("127.0.0.1", p) for p in ports]
    told = [[j for j in range(len(specs)) if j != i] for i in range(len(specs))] if peers is None else peers
    try:
        for i, (spec, port) in enumerate(zip(specs, ports)):
            layers, extra, variant = (*spec, None)[:3]
            daemons.append(Daemon(model, layers, extra=extra, log_dir=log_dir, env=env, port=port,
                                  peer_urls=[urls[j] for j in told[i]], variant=variant, dtype=dtype))
        for d in daemons:
            d.wait_ready()
        for i, d in enumerate(daemons):
            d.wait_peers(len(daemons) - 1 if i == 0 else len(told[i]))
    except BaseException:
        for d in daemons:
            d.stop()
        raise
    return daemons


def run_meshd(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the ``meshd`` command to its end (a refusal, a plan, a fetch) with its output captured as text;
    ``env``, when given, is its whole environment."""
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def run_meshd_in_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`run_meshd` without a Python start of its own: the command runs in this process, in ``env`` as its
    whole environment when given, and what it prints and its exit status come back the same way. For a command
    that ends by itself (a refusal, a plan): starting to serve fails the test."""
    from daemon import cli, logs

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        if env is not None:
            for name in list(os.environ):
                patch.delenv(name)
            for name, value in env.items():
                patch.setenv(name, value)
        for name in ("GOMP_SPINCOUNT", "OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE"):  # meshd sets them when unset
            value = os.environ.get(name)
            patch.setenv(name, value or "")
            if value is None:
                patch.delenv(name)
        patch.setattr(logs, "setup_logging", lambda **_: None)  # this process keeps its own logging
        patch.setattr(cli, "run", lambda app, node: pytest.fail(f"meshd {' '.join(args)} started serving"))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as exc:  # argparse's way out, as the command would leave
                code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["meshd", *args], code, out.getvalue(), err.getvalue())
