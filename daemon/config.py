"""meshd's configuration: the fields of :class:`NodeConfig`, their checks, and how they are loaded.

Each field is declared once, in :class:`NodeConfig`: its default, its command-line flag and help, and
its check. The engine in ``daemon.settings`` derives everything else from that declaration
(:data:`SETTINGS`): the argparse options of ``meshd``, the ``MESHNET_<FIELD>`` variables, the TOML
keys, and the validation, with one precedence order:

    command line  >  environment (MESHNET_*)  >  TOML file  >  defaults

The TOML file is ``meshd.toml`` in the platformdirs config folder (or the file
named by ``--config`` / ``MESHNET_CONFIG``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from daemon.api import TOKEN_PATTERN, TOKEN_RULE, parse_layers
from daemon.host import host_cores
from daemon.settings import (
    ConfigError,
    Given,
    Setting,
    above,
    at_least,
    between,
    merged,
    read_sources,
    setting,
    settings_of,
)

DEFAULT_PORT = 7070


def _token(value: str) -> str | None:
    return None if TOKEN_PATTERN.fullmatch(value) else f"must be {TOKEN_RULE}"


def _layer_range(value: str) -> str | None:
    # only the syntax here: whether the range fits the model is known once the model is read
    try:
        parse_layers(value)
    except ValueError:
        return "must be an inclusive layer range like 0-14 (or one layer, like 7) that does not end before it starts"
    return None


def _address(value: str) -> str | None:
    # what meshd's peer directory accepts: an http(s) URL, or a bare host:port taken as http://
    try:
        parts = urllib.parse.urlsplit(value if "://" in value else f"http://{value}")
        usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # urlsplit and .port raise it for a bad IPv6 literal or a port out of range
        usable = False
    return None if usable and not any(c.isspace() for c in value) else "must be an address like http://127.0.0.1:7071"


def _origins(values: list[str]) -> str | None:
    # a CORS origin is scheme://host[:port], nothing after it; * allows any
    for value in values:
        if value == "*":
            continue
        try:
            parts = urllib.parse.urlsplit(value)
            usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except ValueError:
            usable = False
        if not usable or parts.path or parts.query or parts.fragment or any(c.isspace() for c in value):
            return f"must be origins like https://app.example.com or * ({value!r} is not)"
    return None


DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(?::\d+)?")


def _device(value: str) -> str | None:
    return None if DEVICE_PATTERN.fullmatch(value) else "must be auto, cpu, cuda, cuda:N or mps"


def _addresses(values: list[str]) -> str | None:
    problems = [value for value in values if _address(value)]
    return f"must be addresses like http://127.0.0.1:7071 ({problems[0]!r} is not)" if problems else None


def _model_names(values: list[str]) -> str | None:
    bad = [value for value in values if not value or len(value) > 256 or any(c.isspace() for c in value)]
    return f"must be names of 1 to 256 characters without spaces ({bad[0]!r} is not)" if bad else None


@dataclass
class NodeConfig:
    """A node's settings. Each field's ``setting(...)`` is the only place that field is declared."""

    model: str | None = setting(
        None, flag="--model", help="a local Hugging Face model folder, a .gguf file, or the built-in default "
        "SmolLM2-135M-Instruct (used when absent)")
    layers: str | None = setting(
        None, flag="--layers", help="inclusive layer range to host, e.g. 0-14 (default: every layer)",
        check=_layer_range)
    host: str = setting("127.0.0.1", flag="--host", help="address to bind (default 127.0.0.1)")
    port: int = setting(DEFAULT_PORT, flag="--port", help="port to listen on (default 7070)", check=between(1, 65535))
    peers: list[str] = setting(
        [], flag="--peer", metavar="URL", help="another node, e.g. http://127.0.0.1:7071 (repeatable)",
        check=_addresses)
    kv_cache: bool = setting(
        True, flag="--no-kv-cache", help="keep no session caches: every step runs the full sequence (stateless)")
    threads: int | None = setting(  # None: the machine's cores shared among the daemons computing at each step
        None, flag="--threads", help="torch threads (default: before each step, this host's cores shared among "
        "the daemons on it computing at that moment)", check=at_least(1))
    kv_ttl_seconds: float = setting(
        600.0, flag="--kv-ttl", help="session cache TTL in seconds (default 600)", check=above(0))
    kv_max_sessions: int = setting(
        8, flag="--kv-max-sessions", help="most sessions cached at once (default 8)", check=at_least(1))
    kv_max_bytes: int | None = setting(
        None, flag="--kv-max-bytes", help="byte budget of the session caches (default: none)", check=at_least(0))
    dtype: str = setting(
        "auto", flag="--dtype", choices=("auto", "float32", "bfloat16", "float16"),
        help="compute dtype of this node's weights, caches and activations (default auto: bfloat16 where the "
        "device computes it natively, else float32; float32 gives generate's float32 tokens)")
    device: str = setting(
        "auto", flag="--device", check=_device,
        help="where weights, caches and compute live: auto, cpu, cuda, cuda:N or mps (default auto: a GPU "
        "if torch sees one, else the CPU)")
    quantize: str | None = setting(
        None, flag="--quantize", choices=("int8", "int8-torchao", "int4"),
        help="weight-only quantization of this node's decoder layers: int8 (a quarter of float32's bytes; native "
        "kernels on CPU), int8-torchao (torchao's own, any device, slow on CPU) or int4 (llama.cpp's Q4_0 format: "
        "4.5 bits a weight, an int8 LM head; native kernels on CPU)")
    prefix_reuse: str = setting(
        "shared", flag="--prefix-reuse", choices=("shared", "client", "off"),
        help="as head, start a request from a session the mesh already holds when its prompt begins with that "
        "session's tokens: shared (any client's; default), client (only the same client's: its OpenAI 'user', "
        "else its address; a cached prefix answers faster, which another client could time), or off")
    draft_model: str | None = setting(
        None, flag="--draft-model", metavar="MODEL",
        help="as head, speculative decoding: draft tokens with MODEL (a folder, a .gguf, or built-in: a small model "
        "sharing the served model's tokenizer, run in this process) or ngram (prompt lookup, no model), and verify "
        "them along the route in one pass; answers stay exactly the same (default: none)")
    draft_max: int = setting(
        4, flag="--draft-max", metavar="N", help="the most tokens drafted per step; fewer, or none, where the "
        "measured acceptance and route cost say so (default 4)", check=between(1, 32))
    draft_dtype: str = setting(
        "auto", flag="--draft-dtype", choices=("auto", "float32", "bfloat16", "float16"),
        help="compute dtype of the draft model (default auto: as --dtype, but float32 for an int8 draft on a CPU, "
        "whose products then run natively)")
    draft_quantize: str | None = setting(
        None, flag="--draft-quantize", choices=("int8",), help="weight-only int8 for the draft model's layers "
        "(an int8 copy of the served model is a cheap draft that mostly agrees with it)")
    wire_dtype: str | None = setting(  # None: the compute dtype, which loses nothing
        None, flag="--wire-dtype", choices=("float32", "float16", "bfloat16"),
        help="dtype of activations this node sends as head (default: its compute dtype, exact)")
    # no flag: a request's own max_tokens is the usual way to set it
    max_tokens_default: int = setting(
        256, flag=None, help="max_tokens when a request names none (default 256)", check=at_least(1))
    log_level: str = setting(
        "info", flag="--log-level", choices=("debug", "info", "warning", "error"), help="log level (default info)")
    public_url: str | None = setting(  # None: http://host:port
        None, flag="--public-url", help="the URL peers use to reach this node (default http://HOST:PORT)",
        check=_address)
    route_explore: float = setting(  # share of new generations planned with randomised costs, to re-measure
        0.1, flag="--route-explore", metavar="SHARE", help="share of new generations routed with randomised "
        "costs, so stale latency measurements recover (default 0.1; 0 always takes the fastest known route)",
        check=between(0, 1))
    failover_wait_seconds: float = setting(
        30.0, flag="--failover-wait", metavar="SECONDS", help="when a hop fails mid-generation and no other node "
        "covers its layers, how long to wait for one (e.g. a restart) before the generation fails; also how long "
        "failovers may go on without a token (default 30)",
        check=between(0, 3600))
    hop_timeout_seconds: float = setting(  # longer steps get proportionally more
        10.0, flag="--hop-timeout", metavar="SECONDS", help="a one-token step on a peer must answer within this, "
        "or the peer counts as failed; longer steps get proportionally more (default 10)", check=between(0.1, 3600))
    token: str | None = setting(  # the older name of api_key: load_config gives both fields the key in effect
        None, flag="--token", help="the older name of --api-key (MESHNET_TOKEN likewise): the shared mesh token "
        "every endpoint but /health then needs as 'Authorization: Bearer TOKEN'", check=_token, secret=True)
    max_body_bytes: int = setting(
        64 * 1024 * 1024, flag="--max-body-bytes", metavar="BYTES",
        help="largest request body (default 64 MiB); larger is a 413", check=at_least(1024))
    max_tokens_cap: int = setting(
        4096, flag="--max-tokens-cap", metavar="N", help="the most new tokens a request may ask for "
        "(default 4096, never past the model's context)", check=at_least(1))
    max_batch: int = setting(
        16, flag="--max-batch", metavar="N", help="most sessions whose decode steps run as one forward on this "
        "node (default 16); 1 runs every step alone, exactly as a single session computes it", check=at_least(1))
    tune_kernels: str = setting(
        "on", flag="--tune-kernels", choices=("on", "off"), help="at load, time each weight shape's memory layout "
        "and matrix kernels on this CPU and keep the fastest, remembered per machine (default on); off: "
        "transformers' own products, bit for bit")
    step_tokens: int = setting(
        512, flag="--step-tokens", metavar="N", help="token budget of one step on this node (default 512): a "
        "longer prompt runs in chunks of N, and the sessions decoding here take their steps between them",
        check=at_least(16))
    max_generations: int = setting(
        32, flag="--max-generations", metavar="N", help="generations this node heads at once (default 32); "
        "beyond it, 429 with Retry-After", check=at_least(1))
    shutdown_grace_seconds: float = setting(
        30.0, flag="--shutdown-grace", metavar="SECONDS", help="on SIGTERM or Ctrl+C, how long running "
        "generations get to finish (default 30); a second signal stops at once", check=between(0, 3600))
    log_format: str = setting(
        "auto", flag="--log-format", choices=("auto", "text", "json"),
        help="log lines as text or JSON objects (default auto: text on a terminal, JSON otherwise)")
    # ---- server conventions and TLS (issue 16): the API key, CORS, the context cap, the chat template ----
    api_key: str | None = setting(  # the mesh token under its conventional name; --token is its alias
        None, flag="--api-key", metavar="KEY", help="the mesh's API key: every endpoint but /health then needs "
        "'Authorization: Bearer KEY', and nodes send it to each other (prefer MESHNET_API_KEY or --api-key-file: "
        "arguments show in ps; --token and MESHNET_TOKEN are older names for it)", check=_token, secret=True)
    api_key_file: str | None = setting(
        None, flag="--api-key-file", metavar="PATH", help="read the API key from this file (its first line)")
    allowed_origins: list[str] = setting(
        [], flag="--allowed-origins", metavar="ORIGIN[,ORIGIN]", help="browser origins allowed to call this node "
        "(CORS), e.g. https://app.example.com, or * for any (default: none)", check=_origins)
    max_model_len: int | None = setting(  # None: the model's own context
        None, flag="--max-model-len", metavar="N", help="context cap for requests this node heads: prompt plus "
        "new tokens (default: the model's context; more than it is refused)", check=at_least(2))
    chat_template: str | None = setting(  # None: the model's own template
        None, flag="--chat-template", metavar="FILE", help="a Jinja chat template file used instead of the model's")
    ssl_certfile: str | None = setting(
        None, flag="--ssl-certfile", metavar="PATH", help="serve HTTPS with this certificate chain (PEM; with "
        "--ssl-keyfile)")
    ssl_keyfile: str | None = setting(
        None, flag="--ssl-keyfile", metavar="PATH", help="the private key of --ssl-certfile (PEM)")
    ssl_ca_file: str | None = setting(  # None: the system's trust store
        None, flag="--ssl-ca-file", metavar="PATH", help="CA certificates (PEM) that https:// peers' certificates "
        "must chain to (default: the system's trust store)")

    # ---- the OpenAI API's names for the model ----
    served_model_name: list[str] = setting(  # empty: the model folder's name
        [], flag="--served-model-name", metavar="NAME", check=_model_names,
        help="a name the OpenAI API answers to (repeatable; the first is the one answers report; default: the "
        "model folder's name, e.g. SmolLM2-135M-Instruct)")

    @property
    def url(self) -> str:
        """How peers reach this node: ``public_url``, else ``http(s)://host:port`` (https when serving TLS)."""
        scheme = "https" if self.ssl_certfile else "http"
        return self.public_url or f"{scheme}://{self.host}:{self.port}"


SETTINGS: tuple[Setting, ...] = settings_of(NodeConfig)  # every field of NodeConfig, in declaration order
_BY_NAME = {s.name: s for s in SETTINGS}


def default_config_path() -> Path:
    """``meshd.toml`` in the user's platformdirs config folder, the file read when none is named."""
    return Path(platformdirs.user_config_dir("meshnet")) / "meshd.toml"


def load_config(cli: dict, environ: Mapping[str, str] = os.environ, path: Path | None = None) -> NodeConfig:
    """Merge the sources in precedence order, then check every value that was given, once.

    ``cli`` maps field names to the options the user gave (None: not given). ``path`` is the TOML
    file; without it ``MESHNET_CONFIG`` names it, else :func:`default_config_path`. A bad value is a
    one-line :class:`ConfigError` naming its source: the file and key, the variable, or the flag.
    """
    path = path or (Path(environ["MESHNET_CONFIG"]) if environ.get("MESHNET_CONFIG") else default_config_path())
    sources = read_sources(SETTINGS, cli, environ, path)  # highest precedence first
    given = _one_api_key(merged(SETTINGS, sources), sources)
    return NodeConfig(**{name: _BY_NAME[name].normalized(value) for name, (value, _) in given.items()})


# the API key's names: the first is the field that holds it; the others set it too (the file by its content)
API_KEY_NAMES = ("api_key", "token", "api_key_file")


def _one_api_key(given: Given, sources: tuple[Given, ...]) -> Given:
    """Resolve the API key's names into one key, held by both ``api_key`` and ``token`` (its older name).

    The highest source that names the key decides; two different keys in that one source are an error.
    """
    for source in sources:
        named = {name: source[name] for name in API_KEY_NAMES if name in source}
        if named:
            break
    else:
        return given
    if "api_key_file" in named:
        path, where = named["api_key_file"]
        named["api_key_file"] = (read_api_key_file(path, where), where)
    if len({value for value, _ in named.values()}) > 1:
        places = " and ".join(where for _, where in named.values())
        raise ConfigError(f"{places} both set the API key, to different keys: give one")
    key, where = next(iter(named.values()))
    given = {name: value for name, value in given.items() if name not in API_KEY_NAMES}
    if "api_key_file" in named:  # kept where it supplied the key, so the node can say where its key came from
        given["api_key_file"] = source["api_key_file"]
    return given | {"api_key": (key, where), "token": (key, where)}


def read_api_key_file(path: str, where: str) -> str:
    """The key in the file at ``path`` (its first line, without surrounding blanks); ConfigError if unusable."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where} {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise ConfigError(f"{where} {path}: the file is empty")
    if _token(key):
        raise ConfigError(f"{where} {path}: the key must be {TOKEN_RULE}")
    return key


def default_threads(config: NodeConfig) -> int:
    """The threads a node starts with (loading its weights): the cores shared among this node and its peers on
    a loopback address. From its first step on, the core share follows the daemons computing at each moment
    (``daemon.model.cores``)."""
    local_peers = sum(1 for p in config.peers if any(h in p for h in ("127.0.0.1", "localhost", "[::1]")))
    return max(1, host_cores() // (1 + local_peers))


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the node on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
