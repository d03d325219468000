"""The mesh under test: ``meshd`` processes on 127.0.0.1, the first one the head, and what one generation
on them measured."""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from daemon.api import auth_headers
from daemon.api.launch import LOOPBACK, MeshdProcess, free_ports, node_url, stop_all
from daemon.bench.delay import DelayProxy
from daemon.bench.progress import Progress
from daemon.bench.reference import PROMPT

T = TypeVar("T")


class Mesh:
    """meshd processes on 127.0.0.1, the first one the head; stopped by :meth:`stop`.

    ``specs``: per node, its inclusive layer range and extra arguments; ``node_args`` go to every node.
    ``hop_rtt_ms``: every node but the head is reached through a :class:`DelayProxy` with that round trip.
    Its nodes share the host's cores among themselves only (a cores folder of their own,
    :mod:`daemon.model.cores`): a mesh kept open and idle while another runs, for runs side by side, leaves
    the other's nodes as they are alone (a lone node never parks its team).
    """

    def __init__(self, name: str, specs: list[tuple[str, list[str]]], model: str | None = None,
                 threads: int | None = None, node_args: list[str] = (), hop_rtt_ms: float = 0.0) -> None:
        self.name, self.specs, self.model, self.threads = name, specs, model, threads
        # a mesh with a key (the daemons inherit MESHNET_API_KEY or MESHNET_TOKEN) wants it on every request
        key = os.environ.get("MESHNET_API_KEY") or os.environ.get("MESHNET_TOKEN")
        self.headers = {"Content-Type": "application/json"} | auth_headers(key)
        self.log_dir = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
        env = os.environ | {"MESHNET_CORES_DIR": str(self.log_dir / "cores")}
        self.procs: list[MeshdProcess] = []
        ports = free_ports(len(self.specs))
        self.port = ports[0]
        self.ports = ports
        self.proxies = [DelayProxy(port, hop_rtt_ms) for port in ports[1:]] if hop_rtt_ms > 0 else []
        # what the nodes call each other: through the proxies, the head directly (a client reaches it here)
        urls = [node_url(LOOPBACK, ports[0])] + ([node_url(LOOPBACK, p.port) for p in self.proxies] if self.proxies
                                                 else [node_url(LOOPBACK, p) for p in ports[1:]])
        for i, ((layers, extra), port) in enumerate(zip(self.specs, ports)):
            args = ["--layers", layers, "--port", str(port), *node_args, *extra]
            args += ["--model", self.model] if self.model else []
            args += ["--threads", str(self.threads)] if self.threads else []
            args += ["--public-url", urls[i]] if self.proxies else []
            args += [a for j, url in enumerate(urls) if j != i for a in ("--peer", url)]
            self.procs.append(MeshdProcess(args, env=env, label=f"{self.name} node {layers}",
                                           log_path=self.log_dir / f"{self.name.replace(' ', '-')}-{i}.log"))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            try:
                if sum(p["up"] for p in self._request("GET", "/v1/status")["peers"]) >= len(self.specs) - 1:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the {self.name} mesh did not come up; logs in {self.log_dir}")

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 5.0,
                 port: int | None = None) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None, self.headers)
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{method} {path} answered {resp.status}: {data[:300]!r}")
            return json.loads(data)
        finally:
            conn.close()

    def generate(self, tokens: int, progress: Progress | None = None) -> dict:
        """One streamed generation of exactly ``tokens`` tokens; its ``meshnet`` statistics."""
        return self.chat(PROMPT, tokens, ignore_eos=True, progress=progress)

    def chat(self, messages: list[dict], tokens: int, *, user: str | None = None, ignore_eos: bool = False,
             progress: Progress | None = None) -> dict:
        """One streamed greedy chat completion of up to ``tokens`` tokens: its ``meshnet`` statistics, with
        the answer's ``text`` and ``ttft_ms``, the time from sending the request to its first text as this
        client saw it (to the end of the answer, for one without text). ``user``: the OpenAI ``user`` field."""
        body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": ignore_eos,
                "stream": True} | ({"user": user} if user else {})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        started = time.perf_counter()
        first_text: float | None = None
        parts: list[str] = []
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"the {self.name} mesh answered {resp.status}: {resp.read()[:300]!r}")
            stats = None
            while line := resp.readline():
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"the {self.name} mesh failed: {event['error']}")
                if "meshnet" in event:
                    stats = event["meshnet"]
                elif event["choices"] and (text := event["choices"][0]["delta"].get("content")):
                    first_text = first_text or time.perf_counter()
                    parts.append(text)
                    if progress is not None:
                        progress.step()
        finally:
            conn.close()
        if stats is None:
            raise RuntimeError(f"the {self.name} mesh ended the stream without its statistics")
        ended = time.perf_counter()
        return stats | {"text": "".join(parts), "ttft_ms": ((first_text or ended) - started) * 1000.0}

    def metrics(self, port: int | None = None) -> str:
        """A node's ``/metrics`` (the head's by default), in Prometheus' text format."""
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=5.0)
        try:
            conn.request("GET", "/metrics", headers=self.headers)
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET /metrics answered {resp.status}: {data[:300]!r}")
            return data.decode()
        finally:
            conn.close()

    def measure(self, tokens: int) -> dict:
        """One generation of ``tokens`` tokens with a progress line: the table's numbers."""
        progress = Progress(f"{self.name}, {tokens} tokens", tokens)
        stats = self.generate(tokens, progress)
        progress.end()
        return mesh_row(stats)

    def memory(self) -> list[dict]:
        """Per node: its layers, the bytes of weights it holds, its process's peak resident set so far, and its
        resident set before its first weight was read (its runtime)."""
        nodes = []
        for (layers, _), port, proc in zip(self.specs, self.ports, self.procs):
            status = self._request("GET", "/v1/status", port=port)
            nodes.append({"layers": layers, "dtype": status.get("dtype"),
                          "weights_bytes": sum(status["weights_bytes"].values()),
                          "peak_rss_bytes": _peak_rss_bytes(proc.pid),
                          "runtime_rss_bytes": status.get("memory", {}).get("runtime_rss_bytes")})
        return nodes

    def stop(self) -> None:
        """SIGINT every node, give them 15 s together, then SIGKILL what is left."""
        stop_all(self.procs, signum=signal.SIGINT, grace=15.0)
        for proxy in self.proxies:
            proxy.close()


def _peak_rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")), None)
    except OSError:
        return None


def mesh_row(stats: dict) -> dict:
    """The table's numbers from one generation's ``meshnet`` statistics."""
    remote = [h for h in stats["decode_hops"] if not h["local"] and h["steps"]]
    local = [h for h in stats["decode_hops"] if h["local"] and h["steps"]]
    steps = sum(h["steps"] for h in remote)

    def per_step(key: str, hops: list[dict], n: int) -> float | None:
        return sum(h[key] for h in hops) / n if n else None

    overhead = sum(h["latency_ms"] - h["compute_ms"] for h in remote) / steps if steps else None
    local_steps = sum(h["steps"] for h in local)
    return {
        # a stateless mesh has no prefill step: its first token's time is the prefill
        "prefill_ms": stats["prefill_ms"] or stats["first_token_ms"],
        "decode_tps": stats["decode_tokens_per_second"],
        "step_ms": stats["step_ms"],
        "token_ids": stats["token_ids"],
        "reprefills": stats["reprefills"],
        "cached_tokens": stats["cached_tokens"],  # prompt tokens a reused prefix held: 0 where each run starts cold
        "payload_bytes_per_hop_step": per_step("payload_bytes", remote, steps),
        "wire_bytes_per_hop_step": per_step("sent_bytes", remote, steps),
        "reply_bytes_per_hop_step": per_step("received_bytes", remote, steps),
        "overhead_ms_per_hop_step": overhead,
        "local_overhead_ms_per_step": (sum(h["latency_ms"] - h["compute_ms"] for h in local) / local_steps
                                       if local_steps else None),
        "hops": stats["decode_hops"],
        "drafted_tokens": stats.get("drafted_tokens", 0),
        "accepted_tokens": stats.get("accepted_tokens", 0),
        "verify_steps": stats.get("verify_steps", 0),
    }


def at_once(jobs: list[Callable[[], T]]) -> tuple[list[T], float]:
    """Run every job on a thread of its own, all released together: their results in order and the wall time
    from the release to the last one's end. The first error is raised once every job has ended."""
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []
    release = threading.Barrier(len(jobs) + 1)

    def run(i: int) -> None:
        release.wait()
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - raised below, after the others finish
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for w in workers:
        w.start()
    release.wait()
    started = time.perf_counter()
    for w in workers:
        w.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return results, wall


def many_sessions(mesh: Mesh, sessions: int, tokens: int) -> dict:
    """``sessions`` generations started together: aggregate tokens/s (every token over the wall time), the
    inter-token latencies the head saw (p50/p95 over every session's decode steps), each node's mean batch
    (steps per forward over the run, from its ``/metrics``) and whether every session's tokens were the same."""
    def batches() -> list[tuple[float, float]]:
        texts = [mesh.metrics(port) for port in mesh.ports]
        return [(counter_value(t, "meshnet_batch_size_count"), counter_value(t, "meshnet_batch_size_sum"))
                for t in texts]

    progress = Progress(f"{mesh.name}, {sessions} concurrent session(s) of {tokens} tokens", sessions * tokens)
    before = batches()
    try:
        results, wall = at_once([lambda: mesh.generate(tokens, progress)] * sessions)
    finally:
        progress.end()
    after = batches()
    total = sum(s["completion_tokens"] for s in results)
    gaps = [ms for s in results for ms in s["step_ms"]]
    return {
        "sessions": sessions,
        "tokens_each": tokens,
        "wall_s": wall,
        "aggregate_tps": total / wall,
        "mean_session_decode_tps": sum(s["decode_tokens_per_second"] for s in results) / len(results),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p95_ms": percentile(gaps, 95),
        "mean_batch": [(s1 - s0) / (c1 - c0) if c1 > c0 else None for (c0, s0), (c1, s1) in zip(before, after)],
        "token_ids": results[0]["token_ids"],
        "sessions_agree": all(s["token_ids"] == results[0]["token_ids"] for s in results),
        "load": os.getloadavg()[0],
    }


def paired_sessions(mesh: Mesh, counts: list[int], tokens: int, times: int) -> list[dict]:
    """One session, then each of ``counts`` beyond one, ``times`` rounds, every many-session run right after a
    one-session run of its own: its ratios (aggregate tokens/s, p95 inter-token latency) are to that run, which
    saw the same load of a shared host, and each count's ratios are the median over its pairs
    (``tps_ratio``, ``p95_ratio``). Each count's row is its run of the median aggregate ratio; the one-session
    row is the single run of the median aggregate tokens/s."""
    ones: list[dict] = []
    pairs: dict[int, list[tuple[dict, dict]]] = {count: [] for count in counts if count > 1}
    for _ in range(times):
        if not pairs:
            ones.append(many_sessions(mesh, 1, tokens))
        for count, runs in pairs.items():
            one = many_sessions(mesh, 1, tokens)
            ones.append(one)
            runs.append((one, many_sessions(mesh, count, tokens)))
    rows = [_median_by(ones, lambda one: one["aggregate_tps"]) | {"runs": len(ones), "tps_ratio": 1.0,
                                                                  "p95_ratio": 1.0}]
    for runs in pairs.values():
        gains = [run["aggregate_tps"] / one["aggregate_tps"] for one, run in runs]
        p95s = [run["itl_p95_ms"] / one["itl_p95_ms"] for one, run in runs if run["itl_p95_ms"] and one["itl_p95_ms"]]
        chosen = _median_by(list(zip(gains, (run for _, run in runs))), lambda pair: pair[0])[1]
        rows.append(chosen | {"runs": len(runs), "paired_tps_ratios": gains, "paired_p95_ratios": p95s,
                              "tps_ratio": statistics.median(gains),
                              "p95_ratio": statistics.median(p95s) if p95s else None,
                              "sessions_agree": all(run["sessions_agree"] for _, run in runs),
                              "tokens_match_one": all(run["token_ids"] == one["token_ids"] for one, run in runs)})
    return rows


def _median_by(items: list[T], key: Callable[[T], float]) -> T:
    """The item at the median of ``key`` (the lower middle of an even count)."""
    ordered = sorted(items, key=key)
    return ordered[(len(ordered) - 1) // 2]


def counter_value(metrics: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in Prometheus' text format whose labels include ``labels``."""
    total = 0.0
    for line in metrics.splitlines():
        sample, _, value = line.rpartition(" ")
        metric, _, label_text = sample.partition("{")
        if metric == name and all(f'{key}="{want}"' in label_text for key, want in labels.items()):
            total += float(value)
    return total


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (nearest rank); None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))]
