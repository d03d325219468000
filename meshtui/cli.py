"""The ``meshtui`` command: decide what to run, then run the console.

    meshtui                                   # no peers configured: a local mesh of meshd children
    meshtui --peer 10.0.0.2:7071              # the local head (started or reused) next to that peer
    meshtui --connect http://127.0.0.1:7070   # attach to a running head; start nothing

Only argparse, the config and the plan are imported at the top, so ``meshtui --help`` is instant;
Textual and the app load inside :func:`main`. Nothing here imports torch: the model lives in the
``meshd`` children.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from daemon import __version__
from daemon.api.launch import NODE_INSTALL, console_only, missing_node_packages
from meshtui.config import ConsoleConfig, ConsoleConfigError, default_config_path, normalize_url

LOOPBACK = "127.0.0.1"


class PlanError(ValueError):
    """Options that do not fit together; the message says which and why."""


@dataclass(frozen=True)
class ConsolePlan:
    """What the console runs: ``local`` (a whole mesh of ``nodes`` meshd children), ``peers`` (the
    local head, started or reused on ``head_url``, next to ``peers``) or ``connect`` (``head_url`` only)."""

    kind: Literal["local", "peers", "connect"]
    head_url: str | None = None  # None for "local": the local mesh picks free ports
    peers: tuple[str, ...] = ()
    nodes: int = 2
    model: str | None = None
    layers: str | None = None  # inclusive; what the local head hosts in "peers" (None: what peers leave)
    head_port: int = 7070


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshtui",
        description="The meshnet console: the route, every node's KV sessions with TTLs, tokens per "
        "second, and a chat pane driving generation on the mesh. With no peers configured it starts "
        "a local mesh of meshd daemons on 127.0.0.1 with the built-in model; with peers (in the config "
        "file or --peer) it starts the local head daemon, or reuses one already serving on the "
        "config's head_port, and connects it to them; with --connect it attaches to a running head "
        "and starts nothing. Daemons it starts stop when it exits.",
        epilog=f"Config file: --config, else $MESHTUI_CONFIG, else {default_config_path()}. "
        "Mesh token: if the nodes need one (meshd's MESHNET_API_KEY or MESHNET_TOKEN), set MESHNET_API_KEY or "
        "MESHNET_TOKEN for the console too, "
        "or token = \"...\" in the config file. The console sends it on every request and hands it to the "
        "daemons it starts through their environment; there is no --token option, since command lines show "
        "in ps.",
    )
    p.add_argument("--version", action="version", version=f"meshtui {__version__}")
    p.add_argument("--connect", metavar="URL",
                   help="attach to the head daemon at URL (e.g. http://127.0.0.1:7070) and start nothing")
    p.add_argument("--peer", dest="peers", action="append", default=[], metavar="URL",
                   help="a peer daemon (e.g. 10.0.0.2:7071), added to the config's peers for this run "
                   "only (repeatable); any peer means the local head runs next to the peers")
    p.add_argument("--config", metavar="PATH", help="the console's TOML config file (peers, head_port, "
                   f"local_layers, theme, keys, chat settings; default {default_config_path()})")
    p.add_argument("--model", metavar="M", help="the model local daemons load: a Hugging Face folder, "
                   "a .gguf file, or the built-in SmolLM2-135M-Instruct (default)")
    p.add_argument("--nodes", type=int, metavar="N",
                   help="daemons in the local mesh started when no peers are configured (default 2); "
                   "they split the model's layers evenly")
    p.add_argument("--layers", metavar="A-B", help="inclusive layer range the local head hosts when peers "
                   "are configured (default: the config's local_layers, else the layers no peer hosts)")
    p.add_argument("--ssl-ca-file", metavar="PATH", help="CA certificates (PEM) that https:// nodes' certificates "
                   "must chain to (default: $MESHNET_SSL_CA_FILE, else the system's trust store); daemons the "
                   "console starts get it too")
    p.add_argument("--theme", metavar="NAME", help="Textual theme for this run, e.g. textual-dark, nord, "
                   "gruvbox (default: the config's theme)")
    return p


def plan_console(args: argparse.Namespace, config: ConsoleConfig) -> ConsolePlan:
    """Pick the mode from the options and the config, starting nothing. Raises :class:`PlanError`."""
    try:
        extra = [normalize_url(u) for u in args.peers]
        connect = normalize_url(args.connect) if args.connect is not None else None
    except ValueError as exc:
        raise PlanError(f"--peer/--connect: {exc}") from None
    peers = tuple(dict.fromkeys([*config.peers, *extra]))  # config first, no duplicates
    if args.nodes is not None and args.nodes < 1:
        raise PlanError("--nodes must be at least 1")
    if args.layers is not None:
        _check_layers(args.layers, "--layers")

    if connect is not None:
        ignored = [o for o, v in (("--model", args.model), ("--nodes", args.nodes), ("--layers", args.layers))
                   if v is not None]
        if ignored:
            raise PlanError(f"--connect starts nothing, so {', '.join(ignored)} cannot apply")
        return ConsolePlan(kind="connect", head_url=connect, peers=peers, head_port=config.head_port)
    if peers:
        if args.nodes is not None:
            raise PlanError(f"--nodes sizes the local mesh, which runs only when no peers are configured "
                            f"(peers: {', '.join(peers)})")
        layers = args.layers or config.local_layers
        if layers is not None:
            _check_layers(layers, "local_layers")
        return ConsolePlan(kind="peers", head_url=f"http://{LOOPBACK}:{config.head_port}", peers=peers,
                           model=args.model, layers=layers, head_port=config.head_port)
    if args.layers is not None:
        raise PlanError("--layers is what the local head hosts next to peers; with no peers the local "
                        "mesh splits the layers among --nodes")
    return ConsolePlan(kind="local", nodes=args.nodes or 2, model=args.model, head_port=config.head_port)


def local_mesh_for(plan: ConsolePlan, token: str | None = None):
    """The :class:`~meshtui.local.LocalMesh` a plan needs (not started), or None for ``connect``.

    ``token``: the mesh token its daemons require, and the console sends."""
    if plan.kind == "connect":
        return None  # before the import: meshtui.local loads aiohttp, a third of a second
    from meshtui.local import LocalMesh

    if plan.kind == "local":
        return LocalMesh(nodes=plan.nodes, model=plan.model, token=token)
    return LocalMesh.head_only(port=plan.head_port, peers=plan.peers, layers=plan.layers, model=plan.model,
                               token=token)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = ConsoleConfig.load(Path(args.config) if args.config else None)
        token = config.mesh_token()
        plan = plan_console(args, config)
    except (ConsoleConfigError, PlanError) as exc:
        return _fail(str(exc))
    if args.ssl_ca_file:
        from daemon.api.tls import TLSConfigError, client_context

        try:
            client_context(args.ssl_ca_file)  # a bad file is said now, not as every node "down"
        except TLSConfigError as exc:
            return _fail(str(exc))
        # the variable meshd reads: the console's client and the daemons it starts verify with the same CAs
        os.environ["MESHNET_SSL_CA_FILE"] = args.ssl_ca_file
    if args.theme:
        config.theme = args.theme
    if plan.kind != "connect" and (missing := missing_node_packages()):
        return _fail(f"{console_only(missing)}, so it starts no daemons: attach to a running head with "
                     f"--connect URL, or install the node extra ({NODE_INSTALL})")

    from meshtui.app import MeshApp

    local_mesh = local_mesh_for(plan, token)
    head_url = plan.head_url or local_mesh.head_url
    try:
        app = MeshApp(config, head_url=head_url, peer_urls=plan.peers, local_mesh=local_mesh, poll=True, token=token)
        if args.theme and args.theme not in app.available_themes:
            return _fail(f"--theme {args.theme}: no such theme; known: {', '.join(sorted(app.available_themes))}")
        restore = _stop_on_signals(app, local_mesh)
        try:
            app.run()
        finally:
            restore()
        return app.return_code or 0
    finally:
        if local_mesh is not None:
            local_mesh.stop()


def _stop_on_signals(app, local_mesh) -> Callable[[], None]:
    """SIGTERM/SIGHUP: stop the daemons we started, then let the app leave the terminal tidy.

    The handler only starts a thread: stopping waits for children, and the app must be asked to exit
    through its own loop (``call_from_thread``), not from inside a signal handler."""

    def shutdown(signum: int) -> None:
        if local_mesh is not None:
            local_mesh.stop()
        if signum == getattr(signal, "SIGHUP", None):
            # the terminal is gone: writes to it block the app's loop forever, and there is nothing to tidy
            os._exit(128 + signum)
        # a loop stuck on its terminal must not keep the process alive: give the tidy exit a few seconds
        watchdog = threading.Timer(5.0, os._exit, args=(128 + signum,))
        watchdog.daemon = True
        watchdog.start()
        try:
            app.call_from_thread(app.exit, None, 128 + signum)
        except RuntimeError:  # the app is not running (yet, or any more): nothing to tidy
            os._exit(128 + signum)
        watchdog.cancel()  # the loop took the request: it is alive and will exit tidily

    def handler(signum, _frame) -> None:
        threading.Thread(target=shutdown, args=(signum,), name="meshtui shutdown", daemon=True).start()

    wanted = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {s: signal.signal(s, handler) for s in wanted}

    def restore() -> None:
        for s, old in previous.items():
            signal.signal(s, old)

    return restore


def _check_layers(text: str, what: str) -> None:
    from daemon.api import parse_layers

    try:
        parse_layers(text)
    except ValueError as exc:
        raise PlanError(f"{what}: {exc}") from None


def _fail(message: str, code: int = 2) -> int:
    print(f"meshtui: error: {message}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
