"""The embedded local mesh: real ``meshd`` children on 127.0.0.1, started and stopped by ``LocalMesh``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from meshtui.local import (
    LocalMesh,
    LocalMeshError,
    layers_left_by,
    model_num_layers,
    split_layers,
)
from tests.support.meshd import free_port


class Progress:
    """Collects ``progress(label, line)`` calls."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __call__(self, label: str, line: str) -> None:
        self.lines.append((label, line))

    def of(self, label: str) -> list[str]:
        return [line for lab, line in self.lines if lab == label]


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie nobody has reaped yet counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


async def eventually(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), headers=headers) as session:
        async with session.get(url) as resp:
            return resp.status, await resp.json(content_type=None)


async def chat(url: str) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            return resp.status, await resp.json(content_type=None)


# -- planning, no processes ------------------------------------------------------------------------

def test_layers_are_split_into_contiguous_inclusive_ranges():
    assert split_layers(30, 2) == ["0-14", "15-29"]
    assert split_layers(4, 3) == ["0-1", "2-2", "3-3"]
    assert split_layers(4, 1) == ["0-3"]
    with pytest.raises(ValueError):
        split_layers(4, 5)


def test_a_head_next_to_peers_hosts_what_they_leave():
    assert layers_left_by(30, [(15, 30)]) == "0-14"
    assert layers_left_by(30, [(0, 10), (20, 30)]) == "10-19"
    assert layers_left_by(30, []) == "0-29"  # no peer answered: every layer
    assert layers_left_by(30, [(0, 30)]) == "0-0"  # covered already: the least a node can host


def test_the_layer_count_comes_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 12}}))
    assert model_num_layers(tmp_path) == 12
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(LocalMeshError, match="num_hidden_layers"):
        model_num_layers(tmp_path)


def test_ports_and_urls_are_known_before_start():
    mesh = LocalMesh(nodes=3, base_port=7170)
    assert mesh.urls == ["http://127.0.0.1:7170", "http://127.0.0.1:7171", "http://127.0.0.1:7172"]
    assert mesh.head_url == mesh.urls[0] and mesh.processes == []
    assert len(LocalMesh(layers=["0-1", "2-2", "3-3"]).urls) == 3  # one node per given range
    mesh.stop()  # nothing started: still fine


# -- a two-node mesh of the tiny model, shared by the tests that only read it -----------------------

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tiny_model, tmp_path_factory):
    progress = Progress()
    local = LocalMesh(model=str(tiny_model("llama")), nodes=2, log_dir=tmp_path_factory.mktemp("local-mesh"))
    await local.start(progress)
    yield local, progress
    local.stop()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_progress_arrives_line_by_line_for_each_node(mesh):
    local, progress = mesh
    assert [n.label for n in local.nodes] == ["node 0-1", "node 2-3"]
    for node in local.nodes:
        await eventually(lambda node=node: any(f"serving on {node.url}" in line for line in progress.of(node.label)))
        assert any(line.startswith(f"meshd: loading layers {node.layers} ") for line in progress.of(node.label))
        log = (local.log_dir / f"node-{node.layers}.log").read_text()
        assert f"serving on {node.url}" in log
    assert progress.of("model") == []  # a model folder needs no fetch step


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_every_node_answers_and_the_head_routes_every_layer(mesh):
    local, _ = mesh
    for url in local.urls:
        assert (await get(f"{url}/health"))[0] == 200
    status, route = await get(f"{local.head_url}/v1/route")
    assert status == 200 and route["error"] is None
    layers = [layer for hop in route["hops"] for layer in range(hop["start_layer"], hop["end_layer"])]
    assert layers == [0, 1, 2, 3]
    assert {hop["url"] for hop in route["hops"]} == set(local.urls)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_chat_through_the_head(mesh):
    local, _ = mesh
    status, body = await chat(local.head_url)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4
    assert len(body["meshnet"]["route"]) == 2


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_each_node_knows_the_others_and_shares_the_cores(mesh):
    local, _ = mesh
    for node, other in zip(local.nodes, reversed(local.nodes)):
        argv = node.argv
        assert argv[argv.index("--layers") + 1] == node.layers
        assert "--threads" not in argv  # the cores go to whichever node computes (daemon.model.cores)
        assert [argv[i + 1] for i, a in enumerate(argv) if a == "--peer"] == [other.url]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_head_already_serving_is_reused_and_told_about_peers(mesh):
    local, _ = mesh
    progress = Progress()
    port = local.nodes[0].port
    head = LocalMesh.head_only(port=port, peers=["http://127.0.0.1:9"])
    await head.start(progress)
    assert head.reused and head.processes == [] and head.head_url == local.head_url
    assert any("reusing the meshd already serving" in line for line in progress.of("head"))
    assert any("told it about the peer http://127.0.0.1:9" in line for line in progress.of("head"))
    head.stop()  # stops nothing it did not start
    assert (await get(f"{local.head_url}/health"))[0] == 200
    _, status = await get(f"{local.head_url}/v1/status")
    assert "http://127.0.0.1:9" in [p["url"] for p in status["peers"]]


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_head_next_to_a_peer_hosts_the_layers_it_lacks(mesh, tiny_model):
    local, _ = mesh
    tail = local.nodes[1]  # hosts 2-3
    progress = Progress()
    head = LocalMesh.head_only(port=free_port(), peers=[tail.url], model=str(tiny_model("llama")))
    try:
        await head.start(progress)
        assert not head.reused and head.nodes[0].layers == "0-1"
        assert "peers host layers 2-3; this head hosts 0-1" in progress.of("head")
        argv = head.nodes[0].argv
        assert "--threads" not in argv
        assert [argv[i + 1] for i, a in enumerate(argv) if a == "--peer"] == [tail.url]
        status, body = await chat(head.head_url)  # the head's peers are polled every 2 s: the route appears
        for _ in range(40):
            if status == 200:
                break
            await asyncio.sleep(0.25)
            status, body = await chat(head.head_url)
        assert status == 200, body
        assert [hop["url"] for hop in body["meshnet"]["route"]] == [head.head_url, tail.url]
    finally:
        head.stop()
    assert not any(alive(p.pid) for p in head.processes)


# -- starting and stopping -------------------------------------------------------------------------

@pytest.mark.slow
async def test_the_built_in_model_is_fetched_split_and_stopped_without_a_trace():
    progress = Progress()
    local = LocalMesh(nodes=2)
    await local.start(progress)
    pids = [p.pid for p in local.processes]
    try:
        assert any(line.startswith("meshd: the built-in model is ready in ") for line in progress.of("model"))
        assert [n.label for n in local.nodes] == ["node 0-14", "node 15-29"]
        assert all(alive(pid) for pid in pids)
    finally:
        local.stop()
    assert not any(alive(pid) for pid in pids)
    local.stop()  # twice is fine
    assert all(p.returncode is not None for p in local.processes)
    await asyncio.sleep(0.2)
    assert not any("exited" in line or "killed" in line for _, line in progress.lines)  # stopping is not news


@pytest.mark.slow
async def test_the_mesh_token_guards_the_local_mesh_and_stays_off_command_lines(tiny_model):
    token = "s3cret-mesh-token-0123"
    local = LocalMesh(model=str(tiny_model("llama")), nodes=2, token=token)
    await local.start(Progress())  # ready only once the head's route answered, which takes the token
    try:
        assert (await get(f"{local.head_url}/v1/status"))[0] == 401
        status, body = await get(f"{local.head_url}/v1/status", {"Authorization": f"Bearer {token}"})
        assert status == 200 and all(peer["up"] for peer in body["peers"])  # the nodes use it among themselves
        for process in local.processes:
            assert token not in Path(f"/proc/{process.pid}/cmdline").read_text()  # ps shows command lines
            assert f"MESHNET_TOKEN={token}" in Path(f"/proc/{process.pid}/environ").read_text().split("\0")
        # a console reusing the running head introduces its peers with the token too
        progress = Progress()
        reused = LocalMesh.head_only(port=local.nodes[0].port, peers=["http://127.0.0.1:9"], token=token)
        await reused.start(progress)
        assert reused.reused and "told it about the peer http://127.0.0.1:9" in progress.of("head")
    finally:
        local.stop()


@pytest.mark.slow
async def test_a_node_killed_from_outside_is_reported(tiny_model):
    progress = Progress()
    local = LocalMesh(model=str(tiny_model("llama")), layers=["0-3"])
    await local.start(progress)
    try:
        (node,) = local.nodes
        os.kill(node.process.pid, signal.SIGKILL)
        await eventually(lambda: "meshd killed by SIGKILL" in progress.of("node 0-3"))
        assert [n for n in local.nodes if n.returncode is not None] == [node] and node.returncode == -signal.SIGKILL
    finally:
        local.stop()
    local.stop()


@pytest.mark.slow
async def test_a_node_that_fails_raises_with_meshds_message(tiny_model):
    local = LocalMesh(model=str(tiny_model("llama")), layers=["0-9"])
    with pytest.raises(LocalMeshError) as failure:
        await local.start(Progress())
    message = str(failure.value)
    assert "node 0-9" in message and "exited with code 2" in message
    assert "meshd: error: --layers" in message and "last layer 3" in message
    assert all(p.returncode is not None for p in local.processes)


async def test_a_model_that_cannot_be_had_raises_with_meshds_message(tmp_path):
    local = LocalMesh(model=str(tmp_path / "no-such-model"))
    with pytest.raises(LocalMeshError, match=r"(?s)preparing the model .*no such file or folder"):
        await local.start(Progress())
    assert local.processes == []


async def test_the_model_and_its_layer_count_come_from_fetch_model_s_json_answer(default_model):
    from daemon.model.source import default_gguf_path

    gguf = default_gguf_path()  # the built-in model's own GGUF: fetch-model reads its layer count from the header
    for model, expected in ((str(gguf), (str(gguf.resolve()), 30)), (None, (str(default_model), 30))):
        progress = Progress()
        local = LocalMesh(model=model)
        local._loop, local._progress = asyncio.get_running_loop(), progress  # as start() sets them
        assert await local._model_source() == expected
        await asyncio.sleep(0.1)  # the reader thread hands its lines over through the event loop
        lines = progress.of("model")
        assert lines and not [line for line in lines if line.startswith("{")]  # the answer is not progress
    assert lines[-1] == f"meshd: the built-in model is ready in {default_model}"  # the prose still shows


ORPHAN_SCRIPT = """
import asyncio, json, sys
from meshtui.local import LocalMesh

async def main():
    mesh = LocalMesh(model=sys.argv[1], nodes=2)
    await mesh.start(lambda label, line: None)
    print(json.dumps([p.pid for p in mesh.processes]), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_console_killed_9_leaves_no_orphan(tiny_model):
    console = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(tiny_model("llama"))],
                               stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        line = console.stdout.readline()
        assert line, f"the console exited with {console.wait()} before its mesh was up"
        pids = json.loads(line)
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        console.kill()  # no atexit, no finally: only the parent-death signal is left
        console.wait()
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in pids), "meshd children outlived a console killed with SIGKILL"
    finally:
        if console.poll() is None:
            console.kill()
        console.stdout.close()
