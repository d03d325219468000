"""The embedded local mesh: ``meshd`` child processes on loopback, owned by the console.

The console never imports torch or transformers: it reaches the model only by running ``meshd``
(``python -m daemon.cli``, through :mod:`daemon.api.launch`) as child processes and talking HTTP to
them. No widgets here either: progress goes to a ``progress(label, line)`` callback, called on the
event loop that ran :meth:`LocalMesh.start`.

No orphans: every child gets a parent-death signal (Linux ``PR_SET_PDEATHSIG``), so it is sent
SIGTERM even when the console is killed with SIGKILL; :meth:`LocalMesh.stop` (also run at exit)
stops the rest. The kernel sends that signal when the *thread* that started the child ends, so call
``start`` on an event loop running in the main thread (as ``App.run`` and ``asyncio.run`` do).

Models: a Hugging Face folder is read as it is. A ``.gguf`` file goes to every node as it is, and each
converts only its own layers; ``meshd fetch-model --model FILE --layer-count --json`` reads the layer
count from its header first. Anything else (nothing: the built-in model; its name) goes to
``meshd fetch-model [--model SPEC] --json``, which fetches the built-in model once per machine and
answers where the folder is; so the layer count comes from a ``config.json`` and every node loads the
same converted folder instead of converting it again. The console reads fetch-model's answer from the
JSON object it prints last, never from its prose, which goes to ``progress`` like any child's lines.

The mesh token: the children get the console's token (``MESHNET_TOKEN`` or the config's ``token``)
through their environment, never on their command line, where ``ps`` would show it; the console's
own requests to them carry it too.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import aiohttp

from daemon.api import auth_headers, format_layers, parse_layers
from daemon.api.launch import (
    LOOPBACK,
    STOP_GRACE_S,
    MeshdProcess,
    describe_returncode,
    free_port,
    node_url,
    stop_all,
)
from meshtui.config import TOKEN_VARIABLE

Progress = Callable[[str, str], None]

READY_TIMEOUT_S = 300.0  # a first start on a slow machine imports torch and loads weights per node


class LocalMeshError(RuntimeError):
    """The local mesh could not start; the message says which child and quotes its last output."""


def split_layers(num_layers: int, nodes: int) -> list[str]:
    """``nodes`` contiguous inclusive ranges covering every layer, the first ones one layer longer:
    ``split_layers(30, 2) == ["0-14", "15-29"]``."""
    if not 1 <= nodes <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers among {nodes} nodes")
    size, extra = divmod(num_layers, nodes)
    ranges, start = [], 0
    for i in range(nodes):
        end = start + size + (1 if i < extra else 0)
        ranges.append(format_layers(start, end))
        start = end
    return ranges


def layers_left_by(num_layers: int, hosted: Sequence[tuple[int, int]]) -> str:
    """What a head should host next to peers hosting half-open ranges ``hosted``: the span of the
    layers no peer hosts; every layer when no peer answered; layer 0 alone when the peers already
    cover the model (a node must host something, and the head loads embeddings anyway)."""
    covered = {i for start, end in hosted for i in range(start, end)}
    missing = [i for i in range(num_layers) if i not in covered]
    if not missing:
        return format_layers(0, 1)
    return format_layers(missing[0], missing[-1] + 1)


def model_num_layers(folder: Path) -> int:
    """Decoder layers of the model in a Hugging Face folder, from its ``config.json``."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LocalMeshError(f"{folder}: cannot read config.json ({exc})") from None
    for part in (config, config.get("text_config") or {}):
        if isinstance(part.get("num_hidden_layers"), int):
            return part["num_hidden_layers"]
    raise LocalMeshError(f"{folder}/config.json names no num_hidden_layers")


@dataclass
class LocalNode:
    """One ``meshd`` of the local mesh."""

    label: str  # "node 0-14"
    layers: str | None  # inclusive; None until start has planned it
    port: int
    url: str
    child: MeshdProcess | None = field(default=None, repr=False)

    @property
    def argv(self) -> list[str]:
        """Its meshd's command line (empty until started)."""
        return self.child.argv if self.child else []

    @property
    def process(self) -> subprocess.Popen | None:
        return self.child.popen if self.child else None

    @property
    def returncode(self) -> int | None:
        return self.child.poll() if self.child else None


class LocalMesh:
    """``meshd`` children on this machine: a whole small mesh (``nodes`` of them splitting the model's
    layers, the first one the head), or with :meth:`head_only` one head next to remote peers.

    ``urls`` (head first) and ``head_url`` are known from construction; ``start`` starts the children
    and returns once every one answers ``/health`` (and, for a whole mesh, once the head has a route
    over every layer). ``stop`` is synchronous, idempotent and safe from ``atexit`` and signal handlers.
    """

    def __init__(self, *, nodes: int = 2, model: str | None = None, host: str = LOOPBACK,
                 base_port: int | None = None, peers: Sequence[str] = (), layers: Sequence[str] | None = None,
                 log_dir: Path | None = None, token: str | None = None) -> None:
        if layers is not None:
            layers = list(layers)
            for text in layers:
                parse_layers(text)  # the format only; meshd checks the range against the model
            nodes = len(layers)
        if nodes < 1:
            raise ValueError("a local mesh needs at least one node")
        self.model = model
        self.host = host
        self.peers = list(peers)
        self.layers = layers
        self.log_dir = Path(log_dir) if log_dir else None
        # the children run with exactly this token (or none): cli.main resolved it from MESHNET_TOKEN or the config
        env = {k: v for k, v in os.environ.items() if k != TOKEN_VARIABLE}
        self.child_env = env | ({TOKEN_VARIABLE: token} if token else {})
        self._headers = auth_headers(token)
        ports = [base_port + i for i in range(nodes)] if base_port else [free_port(host) for _ in range(nodes)]
        self.urls: list[str] = [node_url(host, p) for p in ports]
        self.head_url: str = self.urls[0]
        self.nodes: list[LocalNode] = [LocalNode(label="node", layers=None, port=p, url=u)
                                       for p, u in zip(ports, self.urls)]
        self.reused = False  # head_only found a daemon already serving and started nothing
        self._head_only = False
        self._children: list[MeshdProcess] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._progress: Progress | None = None
        self._started = False
        self._stopping = False
        self._stop_lock = threading.RLock()

    @classmethod
    def head_only(cls, *, port: int = 7070, peers: Sequence[str] = (), layers: str | None = None,
                  model: str | None = None, host: str = LOOPBACK, log_dir: Path | None = None,
                  token: str | None = None) -> LocalMesh:
        """The local head next to remote ``peers``: reuses whatever already answers ``/health`` on
        ``port`` (starting nothing), or starts one meshd hosting ``layers`` with ``--peer`` for each
        peer. Without ``layers`` it hosts the layers no reachable peer hosts (every layer if none answers)."""
        mesh = cls(nodes=1, model=model, host=host, base_port=port, peers=peers,
                   layers=[layers] if layers else None, log_dir=log_dir, token=token)
        mesh._head_only = True
        return mesh

    @property
    def processes(self) -> list[subprocess.Popen]:
        """The meshd processes started so far (none when a running head was reused)."""
        return [n.process for n in self.nodes if n.process is not None]

    async def start(self, progress: Progress) -> None:
        """Fetch the model if needed, start every node, and wait until they serve.

        Raises :class:`LocalMeshError` (after stopping whatever it started) when a child fails."""
        if self._started:
            raise RuntimeError("this local mesh was already started")
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._progress = progress
        atexit.register(self.stop)
        try:
            if self._head_only and await _answers_health(self.head_url):
                self.reused = True
                progress("head", f"reusing the meshd already serving on {self.head_url}")
                for peer in self.peers:
                    progress("head", await _introduce(self.head_url, peer, self._headers))
                return
            model, num_layers = await self._model_source()
            ranges = await self._plan_layers(num_layers, progress)
            for i, (node, layers) in enumerate(zip(self.nodes, ranges)):
                node.layers = layers
                node.label = f"node {layers}"
                others = [u for u in self.urls if u != node.url]
                remote = [p for p in self.peers if p not in self.urls] if i == 0 else []
                # no --threads: the nodes share the host's cores step by step, all of them for whichever computes
                args = ["--model", model, "--layers", layers, "--host", self.host, "--port", str(node.port),
                        *[arg for url in [*others, *remote] for arg in ("--peer", url)]]
                node.child = self._spawn(node.label, args)
            await self.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    async def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until every node answers ``/health`` and, when the mesh is all local, the head has a
        route over every layer. A node that exits first, or a timeout, raises :class:`LocalMeshError`."""
        deadline = time.monotonic() + timeout
        pending = [n for n in self.nodes if n.child is not None]
        while pending:
            for node in pending:
                if node.returncode is not None:
                    raise LocalMeshError(f"{node.label} (meshd on port {node.port}) "
                                         f"{describe_returncode(node.returncode)} before it was ready:\n"
                                         f"{node.child.last_output()}")
            answered = await asyncio.gather(*(_answers_health(n.url) for n in pending))
            pending = [n for n, ok in zip(pending, answered) if not ok]
            if pending and time.monotonic() > deadline:
                node = pending[0]
                raise LocalMeshError(f"{node.label} did not answer {node.url}/health within {timeout:.0f} s; "
                                     f"its last output:\n{node.child.last_output()}")
            if pending:
                await asyncio.sleep(0.2)
        if self._head_only or self.reused:
            return  # remote peers may be down or slow: the console shows the route as it is
        error = "no answer"
        while time.monotonic() < deadline:
            error = await _route_error(self.head_url, self._headers)
            if error is None:
                return
            await asyncio.sleep(0.3)
        raise LocalMeshError(f"the head {self.head_url} has no route over every layer after {timeout:.0f} s: {error}")

    def stop(self) -> None:
        """SIGTERM every child, give them a few seconds, then SIGKILL what is left. Idempotent."""
        with self._stop_lock:
            self._stopping = True
            stop_all(self._children, signum=signal.SIGTERM, grace=STOP_GRACE_S)
        atexit.unregister(self.stop)

    # -- inside start ---------------------------------------------------------------------------

    def _spawn(self, label: str, args: list[str], *, report_exit: bool = True,
               on_line: Callable[[str], None] | None = None) -> MeshdProcess:
        """``meshd ARGS`` whose lines reach ``progress`` under ``label``, or ``on_line`` when given (and its
        log file, with a log_dir)."""
        log_path = self.log_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "-", label) + ".log") if self.log_dir else None
        with self._stop_lock:
            if self._stopping:
                raise LocalMeshError("the local mesh is stopping")
            child = MeshdProcess(args, label=label, env=self.child_env, log_path=log_path,
                                 on_line=on_line or partial(self._deliver, label),
                                 on_exit=partial(self._report_exit, label) if report_exit else None)
            self._children.append(child)
        return child

    def _report_exit(self, label: str, code: int) -> None:
        if not self._stopping:  # the ends we cause ourselves are not news
            self._deliver(label, f"meshd {describe_returncode(code)}")

    def _deliver(self, label: str, line: str) -> None:
        """Hand a child's line to ``progress`` on the event loop (called from reader threads)."""
        if self._progress is None or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._progress, label, line)
        except RuntimeError:  # the loop is closed: the console is gone, the log file still has it
            pass

    async def _model_source(self) -> tuple[str, int]:
        """What every node gets as ``--model`` (a folder, or a .gguf file each converts its range of), and the
        model's layer count; a child fetches the built-in model, or reads a .gguf's header, when needed."""
        if self.model is not None and (Path(self.model) / "config.json").is_file():
            folder = Path(self.model).resolve()
            return str(folder), model_num_layers(folder)
        gguf = Path(self.model).expanduser() if self.model is not None else None
        if gguf is not None and gguf.is_file() and gguf.suffix.lower() == ".gguf":
            layers = await self._fetch_model(["--model", str(gguf), "--layer-count"], "layers", int)
            return str(gguf.resolve()), layers
        spec = ["--model", self.model] if self.model is not None else []
        folder = Path(await self._fetch_model(spec, "folder", str))
        return str(folder), model_num_layers(folder)

    async def _fetch_model(self, args: list[str], key: str, kind: type):
        """``key`` of the answer of ``meshd fetch-model ARGS --json``, which must end well and answer it."""
        answers: list[dict] = []
        child = self._spawn("model", ["fetch-model", *args, "--json"], report_exit=False,
                            on_line=partial(self._take_answer, answers))
        while child.poll() is None:
            await asyncio.sleep(0.1)
        output = child.last_output()  # also lets the reader take in the last lines
        answer = answers[-1].get(key) if answers else None
        if child.returncode != 0 or type(answer) is not kind:
            what = "fetching the built-in model" if self.model is None else f"preparing the model {self.model}"
            raise LocalMeshError(f"{what} failed ({describe_returncode(child.returncode)}):\n{output}")
        return answer

    def _take_answer(self, answers: list[dict], line: str) -> None:
        """A line of fetch-model: its JSON answer is kept, anything else is progress (reader thread)."""
        if line.startswith("{"):
            try:
                answer = json.loads(line)
            except ValueError:
                answer = None
            if isinstance(answer, dict):
                answers.append(answer)
                return
        self._deliver("model", line)

    async def _plan_layers(self, num_layers: int, progress: Progress) -> list[str]:
        """Inclusive ranges, one per node: as given, split evenly, or (head only) what peers leave."""
        if self.layers is not None:
            return list(self.layers)
        if not self._head_only:
            try:
                return split_layers(num_layers, len(self.nodes))
            except ValueError as exc:
                raise LocalMeshError(f"{exc}: the model has {num_layers} layers; use fewer nodes") from None
        hosted = [r for r in await asyncio.gather(*(_hosted_layers(p, self._headers) for p in self.peers)) if r]
        layers = layers_left_by(num_layers, hosted)
        if self.peers:
            what = ", ".join(format_layers(*r) for r in hosted) or "nothing (no peer answered)"
            progress("head", f"peers host layers {what}; this head hosts {layers}")
        return [layers]


async def _answers_health(url: str, timeout: float = 1.5) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(f"{url}/health") as resp:
                return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def _route_error(head_url: str, headers: dict[str, str]) -> str | None:
    """None once the head's route covers every layer, else why not."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3.0), headers=headers) as session:
            async with session.get(f"{head_url}/v1/route", params={"refresh": "1"}) as resp:
                body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if resp.status == 401:
        return "401: wrong or missing token"
    if body.get("error") or not body.get("hops"):
        return str(body.get("error") or "no hops")
    return None


async def _hosted_layers(peer: str, headers: dict[str, str]) -> tuple[int, int] | None:
    """The half-open layer range a peer hosts, from its ``/v1/status``; None if it does not answer."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3.0), headers=headers) as session:
            async with session.get(f"{peer}/v1/status") as resp:
                body = await resp.json(content_type=None)
        return int(body["start"]), int(body["end"])
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError):
        return None


async def _introduce(head_url: str, peer: str, headers: dict[str, str]) -> str:
    """Tell a running head about a peer (``POST /v1/peers``); a line saying how it went."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0), headers=headers) as session:
            async with session.post(f"{head_url}/v1/peers", json={"url": peer}) as resp:
                if resp.status == 200:
                    return f"told it about the peer {peer}"
                if resp.status == 401:
                    return f"it refused the peer {peer}: 401, wrong or missing token (set {TOKEN_VARIABLE})"
                return f"it refused the peer {peer}: HTTP {resp.status} {(await resp.text())[:200]}"
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return f"could not tell it about the peer {peer}: {type(exc).__name__}: {exc}"
