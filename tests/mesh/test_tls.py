"""TLS between nodes: a two-node HTTPS mesh whose hops, polls and status requests are verified against
the mesh's own CA (built with trustme), and a node whose certificate another CA signed is refused as a peer.
Real meshd processes on 127.0.0.1 with the built-in model; tokens are checked against ``generate``."""

from __future__ import annotations

import time

import pytest

from tests.support.meshd import Daemon, free_port

pytestmark = pytest.mark.slow

TOKENS = 12
KEY = "tls-mesh-api-key-0123456789"  # by its conventional name: the nodes send it to each other over TLS
PROMPT = [{"role": "user", "content": "Tell me about owls."}]


def https(port: int) -> str:
    return f"https://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The mesh's CA and a rogue one, each with a certificate for 127.0.0.1, as PEM files."""
    trustme = pytest.importorskip("trustme")
    folder = tmp_path_factory.mktemp("pki")
    for name in ("mesh", "rogue"):
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(folder / f"{name}-ca.pem"))
        cert = ca.issue_cert("127.0.0.1", "localhost")
        cert.private_key_and_cert_chain_pem.write_to_path(str(folder / f"{name}-node.pem"))
    # this test process trusts both, so it can ask the rogue node too; the nodes trust only the mesh's CA
    (folder / "both-ca.pem").write_text((folder / "mesh-ca.pem").read_text() + (folder / "rogue-ca.pem").read_text())
    return folder


@pytest.fixture(scope="module")
def tls_mesh(default_model, pki, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    ports = {name: free_port() for name in ("head", "tail", "rogue")}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SSL_CERT_FILE", str(pki / "both-ca.pem"))  # this process's urllib and http.client

        def node(name: str, layers: str, issuer: str, peers: list[str]) -> Daemon:
            tls = ["--ssl-certfile", str(pki / f"{issuer}-node.pem"), "--ssl-keyfile", str(pki / f"{issuer}-node.pem"),
                   "--ssl-ca-file", str(pki / "mesh-ca.pem")]
            return Daemon(default_model, layers, port=ports[name], extra=tls, log_dir=logs,
                          peer_urls=[https(ports[p]) for p in peers], env={"MESHNET_API_KEY": KEY})

        daemons = {"head": node("head", "0-14", "mesh", ["tail", "rogue"]),
                   "tail": node("tail", "15-29", "mesh", ["head"]),
                   "rogue": node("rogue", "15-29", "rogue", [])}
        try:
            for daemon in daemons.values():
                daemon.wait_ready()
            daemons["head"].wait_peers(1)
            yield daemons
        finally:
            for daemon in daemons.values():
                daemon.stop()


def peer_entry(head: Daemon, url: str, timeout: float = 20.0) -> dict:
    """The head's peer entry for ``url`` once a poll reached the node (started with the head, so the
    first polls may have found nothing listening yet): up, or an error that is not a refused connection."""
    deadline = time.monotonic() + timeout
    while True:
        entry = next(p for p in head.get("/v1/status")["peers"] if p["url"] == url)
        reached = entry["up"] or (entry["error"] and "Connect call failed" not in entry["error"])
        if reached or time.monotonic() > deadline:
            return entry
        time.sleep(0.2)


def test_a_tls_mesh_generates_generates_tokens_over_verified_hops(tls_mesh, reference_tokens):
    head, tail = tls_mesh["head"], tls_mesh["tail"]
    status = head.get("/v1/status")
    assert status["url"] == head.url  # it advertises its https address
    status, body = head.chat({"messages": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["meshnet"]["token_ids"] == reference_tokens(PROMPT, TOKENS, ignore_eos=True)
    assert [hop["url"] for hop in body["meshnet"]["route"]] == [head.url, tail.url]
    # the tail served the steps, so the hops really went over TLS: the node serves nothing else
    assert tail.get("/v1/status")["steps_served"] >= TOKENS


def test_a_node_with_an_untrusted_certificate_is_refused_as_a_peer(tls_mesh):
    head, rogue = tls_mesh["head"], tls_mesh["rogue"]
    entry = peer_entry(head, rogue.url)
    assert entry["up"] is False
    assert "certificate is not trusted" in (entry["error"] or ""), (entry, head.log()[-3000:], rogue.log()[-2000:])
    route = head.get("/v1/route?refresh=1")
    assert rogue.url not in [hop["url"] for hop in route["hops"]]
    assert rogue.url not in route["nodes"]  # never measured: no hop was ever sent to it
    assert rogue.get("/v1/status")["steps_served"] == 0


async def test_the_console_connects_to_https_nodes_with_the_mesh_ca(tls_mesh, pki, monkeypatch):
    from meshtui.client import DaemonClient, DaemonError

    monkeypatch.delenv("SSL_CERT_FILE")
    monkeypatch.delenv("MESHNET_SSL_CA_FILE", raising=False)
    client = DaemonClient(ssl_ca_file=str(pki / "mesh-ca.pem"), token=KEY)
    try:
        status = await client.status(tls_mesh["head"].url)
        assert status.layers == "0-14"
        with pytest.raises(DaemonError, match="certificate is not trusted") as refused:
            await client.status(tls_mesh["rogue"].url)
    finally:
        await client.close()
    # the console's mesh view shows a node's poll error as the reason it is down
    from meshtui.screens.mesh import _down_line
    from meshtui.state import NodeState

    node = NodeState(tls_mesh["rogue"].url)
    node.record(None, None, str(refused.value), 0.0)
    assert "certificate is not trusted" in _down_line(node, 0.0)
    monkeypatch.setenv("MESHNET_SSL_CA_FILE", str(pki / "mesh-ca.pem"))  # meshd's variable works for it too
    client = DaemonClient(token=KEY)
    try:
        assert (await client.status(tls_mesh["tail"].url)).layers == "15-29"
    finally:
        await client.close()
    monkeypatch.delenv("MESHNET_SSL_CA_FILE")
    untrusting = DaemonClient()  # the system's store knows no test CA
    try:
        with pytest.raises(DaemonError, match="not trusted.*--ssl-ca-file"):
            await untrusting.status(tls_mesh["head"].url)
    finally:
        await untrusting.close()
