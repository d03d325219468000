"""The ``meshd`` command: run a node, or fetch the built-in model ahead of time.

    meshd --layers 0-14 --port 7070 --peer http://127.0.0.1:7071
    meshd fetch-model
    meshd fetch-model --json      # the same, answering {"folder": PATH} on stdout, for programs
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import logging
import os
import sys
import time

from daemon import __version__
from daemon.api.launch import NODE_INSTALL, console_only, missing_node_packages
from daemon.config import SETTINGS, default_config_path, default_threads, is_loopback, load_config
from daemon.host import prefer_huge_pages
from daemon.settings import ConfigError

STOP_WAIT_SECONDS = 2.0  # after the grace: how long generations get to reach their next step and end
GOMP_SPINS = 100_000  # 2.3-2.7 ms of spinning on the 2-core Xeon measured (scripts/spin_count.py); CPUs differ


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshd",
        description="A meshnet node: hosts a range of a model's decoder layers and serves /forward "
        "and an OpenAI-compatible chat API. `meshd fetch-model` fetches the built-in model ahead of time; "
        "`meshd bench` measures the mesh against single-process generate.",
        epilog=f"Precedence: command line, then MESHNET_* environment, then {default_config_path()}, then defaults.",
    )
    p.add_argument("--version", action="version", version=f"meshd {__version__}")
    for setting in SETTINGS:  # every option comes from the one table of fields in daemon.config
        if setting.flag:
            p.add_argument(setting.flag, **setting.argparse_options())
    p.add_argument("--config", help=f"TOML config file (default {default_config_path()})")
    return p


def _fetch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshd fetch-model", description="Make a model ready to load, as "
                                "`meshd --model` would, and say where it is: fetch and convert the built-in model "
                                "(SmolLM2-135M-Instruct) into the user cache folder once, convert a .gguf file "
                                "(or a range of its layers) into it once, or check a model folder.")
    p.add_argument("--model", help="a local Hugging Face model folder, a .gguf file, or the built-in "
                   "default SmolLM2-135M-Instruct (used when absent)")
    p.add_argument("--force", action="store_true", help="fetch and convert the built-in model again even if "
                   "cached (not with --model)")
    p.add_argument("--layers", help="with a .gguf file: convert only these layers (inclusive, e.g. 15-29), as a node "
                   "hosting them does; every layer when absent")
    p.add_argument("--layer-count", action="store_true", help="with a .gguf file: only say how many layers it has "
                   "(read from its header; nothing is converted)")
    p.add_argument("--json", action="store_true", help='also print the result on stdout as one JSON object, '
                   '{"folder": PATH} (with --layer-count, {"layers": N}), for programs; what it says on stderr '
                   "stays for people")
    return p


def _say(message: str) -> None:
    print(f"meshd: {message}", file=sys.stderr, flush=True)


def _fail(message: str, code: int = 1) -> int:
    print(f"meshd: error: {message}", file=sys.stderr, flush=True)
    return code


def _answer(result: dict, as_json: bool) -> int:
    """With ``--json``, ``result`` as one JSON line on stdout (what the console reads); 0 either way."""
    if as_json:
        print(json.dumps(result), flush=True)
    return 0


def fetch_model(argv: list[str]) -> int:
    """``meshd fetch-model [--model SPEC]``: resolve a model spec into a loadable folder, with progress
    on stderr, ending with a line ``meshd: ... is ready in PATH``; with ``--json``, then
    ``{"folder": PATH}`` on stdout (``{"layers": N}`` for ``--layer-count``)."""
    from daemon.api import parse_layers
    from daemon.errors import ModelUnavailable
    from daemon.model.source import fetch_default_model, gguf_model_file, gguf_range_folder, resolve_model

    parser = _fetch_parser()
    args = parser.parse_args(argv)
    if args.force and args.model is not None:
        parser.error("--force fetches the built-in model again; it does not go with --model")
    gguf = gguf_model_file(args.model)
    if (args.layers or args.layer_count) and gguf is None:
        parser.error("--layers and --layer-count go with --model FILE.gguf")
    try:
        if args.model is None:
            path = fetch_default_model(progress=_say, force=args.force)
        elif args.layers or args.layer_count:
            from daemon.model.gguf_convert import gguf_layer_count  # torch: only a .gguf needs it here

            num_layers = gguf_layer_count(gguf)
            if args.layer_count:
                _say(f"{gguf.name} has {num_layers} layers")
                return _answer({"layers": num_layers}, args.json)
            try:
                start, end = parse_layers(args.layers, num_layers=num_layers)
            except ValueError as exc:
                parser.error(f"--layers: {exc} ({gguf.name} has {num_layers} layers)")
            path = gguf_range_folder(gguf, start, end, progress=_say)
        else:
            path = resolve_model(args.model, progress=_say)
    except ModelUnavailable as exc:
        return _fail(exc.message)
    _say(f"{'the built-in model' if args.model is None else 'the model'} is ready in {path}")
    return _answer({"folder": str(path)}, args.json)


class Refused(Exception):
    """meshd cannot start as configured; the message says why (exit ``code``: 2 for bad options)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def load_node(argv: list[str]):
    """Read the options, set up logging and load the node they describe (blocking; raises :class:`Refused`)."""
    args = _serve_parser().parse_args(argv)
    from pathlib import Path

    try:
        config = load_config(
            {k: v for k, v in vars(args).items() if k != "config"},
            path=Path(args.config) if args.config else None,
        )
    except ConfigError as exc:
        raise Refused(str(exc), 2) from None
    from daemon.logs import setup_logging

    setup_logging(level=config.log_level, fmt=config.log_format, node=config.url)
    if not is_loopback(config.host) and not config.api_key:
        for line in (f"WARNING: listening on {config.host} without an API key: anyone who can reach this port can",
                     "WARNING: run generations, read session ids and send activations. Set MESHNET_API_KEY (the",
                     "WARNING: same on every node) or bind 127.0.0.1."):
            _say(line)
    from daemon.api.tls import NodeTLS, TLSConfigError, client_context, server_context
    from daemon.errors import ModelUnavailable
    from daemon.model.tokenizer import read_chat_template

    if bool(config.ssl_certfile) != bool(config.ssl_keyfile):
        raise Refused("--ssl-certfile and --ssl-keyfile go together: give both, or neither", 2)
    if config.ssl_certfile and (config.public_url or "").lower().startswith("http://"):
        raise Refused(f"--public-url {config.public_url}: this node serves HTTPS (--ssl-certfile), so peers and "
                      "clients must reach it at an https:// address", 2)
    try:  # files are read now: a bad one is refused before the model loads, not on the first request
        tls = NodeTLS(server=server_context(config.ssl_certfile, config.ssl_keyfile) if config.ssl_certfile else None,
                      client=client_context(config.ssl_ca_file))
        chat_template = read_chat_template(config.chat_template) if config.chat_template else None
    except TLSConfigError as exc:
        raise Refused(str(exc), 2) from None
    except ModelUnavailable as exc:
        raise Refused(exc.message, 2) from None
    threads = config.threads or default_threads(config)
    # before torch is imported: OpenMP workers spin a while after a parallel region, then sleep. A step runs
    # hundreds of small regions a few microseconds apart: a worker that slept after each one (as with
    # OMP_WAIT_POLICY=PASSIVE) costs a futex wake-up per region, a fifth of a step's time. Shorter spins
    # (10,000-50,000) measured no better in a co-located mesh (docs/adr/0032-no-shorter-openmp-spins.md).
    os.environ.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINS))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    from daemon.model.quantize import keep_torchao_unloaded  # imports torch: after the two above

    keep_torchao_unloaded()

    from daemon.model.device import dtype_name, resolve_device, resolve_dtype

    try:
        device = resolve_device(config.device)  # an absent device is said before the model code is imported
    except ModelUnavailable as exc:
        raise Refused(exc.message) from None
    from daemon.api import format_layers, parse_layers
    from daemon.model.checkpoint import read_context_length, read_model_info
    from daemon.model.gguf_convert import gguf_layer_count
    from daemon.model.source import gguf_model_file, gguf_range_folder, resolve_model
    from daemon.model.tokenizer import check_chat_template
    from daemon.node import Node

    started = time.perf_counter()
    try:
        gguf = gguf_model_file(config.model)  # converted by layer range: the range is checked against its header
        folder = None if gguf else resolve_model(config.model, progress=_say)
        num_layers = gguf_layer_count(gguf) if gguf else read_model_info(folder).num_layers
        try:
            start, end = (0, num_layers)
            if config.layers:
                start, end = parse_layers(config.layers, num_layers=num_layers)
        except ValueError as exc:
            raise Refused(f"--layers: {exc}" + (f" ({gguf.name} has {num_layers} layers)" if gguf else ""), 2) from None
        if gguf:  # dequantized straight into the compute dtype: the cache holds what the node will hold
            config = dataclasses.replace(config, dtype=dtype_name(resolve_dtype(config.dtype, device)))
            folder = gguf_range_folder(gguf, start, end, dtype=config.dtype, progress=_say)
        info = read_model_info(folder)
        context = read_context_length(folder)
        if config.max_model_len and config.max_model_len > context:
            raise Refused(f"--max-model-len {config.max_model_len} is more than the model's context ({context})", 2)
        if chat_template is not None:
            try:
                check_chat_template(folder, chat_template, config.chat_template)
            except ModelUnavailable as exc:
                raise Refused(exc.message, 2) from None
        _say(f"loading layers {format_layers(start, end)} of {info.name} ({info.num_layers} layers) "
             f"with {threads} thread(s)")
        node = Node.load(config, folder, start, end, threads, tls=tls, chat_template=chat_template)
        if config.draft_model:
            node.head.drafter = load_drafter(config, node, folder, device)
    except ModelUnavailable as exc:
        raise Refused(exc.message) from None
    weights = sum(node.service.shard.loaded_bytes().values())
    _say(f"loaded in {time.perf_counter() - started:.1f} s, {weights / 1e6:.0f} MB of weights in "
         f"{node.service.dtype} on {node.service.shard.device}; "
         f"kv cache {'on' if node.service.supports_kv_cache else 'off'}")
    return node


def load_drafter(config, node, target_folder, device):
    """``--draft-model``: prompt lookup, or a small model loaded on the node's torch thread and checked to share
    the served model's tokenizer."""
    from daemon.mesh.speculation import NgramDrafter

    if config.draft_model.strip().lower() == "ngram":
        _say(f"speculative decoding: drafting up to {config.draft_max} tokens by prompt lookup")
        return NgramDrafter()
    import torch

    from daemon.errors import ModelUnavailable
    from daemon.model.checkpoint import read_model_info
    from daemon.model.device import dtype_name, resolve_dtype
    from daemon.model.draft import DraftModel
    from daemon.model.gguf_convert import gguf_layer_count
    from daemon.model.quantize import check_quantization
    from daemon.model.source import gguf_model_file, gguf_range_folder, resolve_model
    from daemon.model.tokenizer import ChatTokenizer

    if config.draft_dtype == "auto" and config.draft_quantize == "int8" and device.type == "cpu":
        dtype = torch.float32  # int8 products take float32 inputs natively (daemon/model/gemv.c): the fastest draft
    else:
        dtype = resolve_dtype(config.draft_dtype, device)
    if config.draft_quantize:
        check_quantization(config.draft_quantize, dtype, device)
    spec = None if config.draft_model.strip().lower() in ("built-in", "builtin") else config.draft_model
    try:
        gguf = gguf_model_file(spec)
        folder = (gguf_range_folder(gguf, 0, gguf_layer_count(gguf), dtype=dtype_name(dtype), progress=_say)
                  if gguf else resolve_model(spec, progress=_say))
    except ModelUnavailable as exc:  # said of --model: this is the draft's
        raise ModelUnavailable(exc.message.replace("--model ", "--draft-model ", 1)) from None
    service = node.service
    drafter = service.executor.submit(
        DraftModel.load, folder, service.run, dtype=dtype, quantize=config.draft_quantize,
        tune_kernels=config.tune_kernels == "on").result()
    target = ChatTokenizer.load(target_folder, service.shard.config)
    drafter.check_tokenizer(target)
    _say(f"speculative decoding: drafting up to {config.draft_max} tokens with {drafter.name} "
         f"({read_model_info(folder).num_layers} layers, {dtype_name(dtype)}"
         f"{', int8' if config.draft_quantize else ''})")
    return drafter


def node_app(node):
    """The node's HTTP application, as its configuration asks."""
    from daemon.server.app import create_app

    return create_app(node, token=node.config.api_key, max_body_bytes=node.config.max_body_bytes,
                      allowed_origins=node.config.allowed_origins)


def run(app, node) -> int:
    """Serve ``app`` until a signal stops it (see :func:`serve_until_stopped`), then leave at once."""
    from daemon.server.loop import loop_factory

    config = node.config
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve_until_stopped(app, node))
    except OSError as exc:
        return _fail(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}")
    # everything is closed and nothing is left to write: skip the interpreter's teardown of torch and
    # the model, which takes ~3 s on a small machine and keeps supervisors (and the console) waiting
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(argv: list[str]) -> int:
    # importing torch and transformers and building the model make millions of objects that last and almost no
    # cyclic garbage: the collector's passes over them took a fifth of a node's start. Off while loading; then
    # what was made is frozen (out of every later pass: shorter pauses while serving) and collection goes on.
    gc.disable()
    try:
        node = load_node(argv)
    except Refused as exc:
        return _fail(exc.message, exc.code)
    finally:
        gc.freeze()
        gc.enable()
    return run(node_app(node), node)


async def serve_until_stopped(app, node) -> None:
    """Serve until SIGTERM or SIGINT, then drain: /health turns 503, new work gets 503 with Retry-After,
    running generations get ``shutdown_grace_seconds`` to finish, then the node stops. A second signal
    stops it at once."""
    import signal

    from aiohttp import web

    config = node.config
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port, shutdown_timeout=1.0, ssl_context=node.tls.server).start()
        _say(f"serving on {config.url}")
        stop, now = asyncio.Event(), asyncio.Event()

        def on_signal(signum: int) -> None:
            (now if stop.is_set() else stop).set()

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        await stop.wait()
        node.draining = True
        moved = await node.hand_over_sessions()  # other heads' sessions go on at nodes taking these layers over
        await node.say_leaving(moved)  # the heads routing through this node leave it now, not at their next poll
        head = node.head
        running = head.active_generations
        _say(f"draining: {running} generation(s) running, {config.shutdown_grace_seconds:g} s to finish"
             if running else "stopping")
        deadline = loop.time() + config.shutdown_grace_seconds
        while head.active_generations and loop.time() < deadline and not now.is_set():
            await asyncio.sleep(0.1)
        if head.active_generations:
            _say(f"stopping with {head.active_generations} generation(s) unfinished")
            head.stop_generations()  # each ends at its next step; its client is told why
            deadline = loop.time() + STOP_WAIT_SECONDS
            while head.active_generations and loop.time() < deadline and not now.is_set():
                await asyncio.sleep(0.02)
    finally:
        await runner.cleanup()
    _say("stopped")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prefer_huge_pages()  # before torch allocates: the weights every node and bench reads go on huge pages
    missing = missing_node_packages()
    if missing:
        print(f"meshd: error: {console_only(missing)}; a node needs the node extra: {NODE_INSTALL}",
              file=sys.stderr)
        return 2
    # transformers imports torchao wherever it is installed, and that import logs, at every start, the CUDA
    # kernels a CPU build cannot load and torch's deprecation of how it registers its enums: noise, not news
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if argv[:1] == ["fetch-model"]:
        return fetch_model(argv[1:])
    if argv[:1] == ["bench"]:
        from daemon.bench import main as bench

        return bench(argv[1:])
    if argv[:1] == ["plan"]:
        from daemon.plan import main as plan

        return plan(argv[1:])
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
