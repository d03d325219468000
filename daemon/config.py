"""meshd's configuration, with one precedence order:

    command line  >  environment (MESHNET_*)  >  TOML file  >  defaults

Each field is declared once, in :class:`NodeConfig`: its default, its command-line flag and help, and
its check. Everything else is derived from that declaration (:data:`SETTINGS`): the argparse options
of ``meshd``, the ``MESHNET_<FIELD>`` variables, the TOML keys (the field names) with their types, and
the validation, applied once to each value that was given, whatever its source.

The TOML file is ``meshd.toml`` in the platformdirs config folder (or the file
named by ``--config`` / ``MESHNET_CONFIG``).
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import tomllib
import typing
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import platformdirs

from daemon.api import TOKEN_PATTERN, TOKEN_RULE, parse_layers
from daemon.host import host_cores

DEFAULT_PORT = 7070

# What is wrong with a value, as the end of a sentence ("must be at least 1"), or None when it is fine.
Check = Callable[[typing.Any], str | None]


def between(low: float, high: float) -> Check:
    """A check that a number lies in ``[low, high]``."""
    return lambda value: None if low <= value <= high else f"must be between {low:g} and {high:g}"


def at_least(low: float) -> Check:
    """A check that a number is ``low`` or more."""
    return lambda value: None if value >= low else f"must be at least {low:g}"


def above(low: float) -> Check:
    """A check that a number is more than ``low``."""
    return lambda value: None if value > low else f"must be greater than {low:g}"


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


def setting(default, *, flag: str | None, help: str, metavar: str | None = None, choices: tuple[str, ...] = (),
            check: Check | None = None, secret: bool = False):
    """Declare a :class:`NodeConfig` field with how the command line, environment and TOML file set it.

    ``flag`` is the command-line option (None: none; the variable and the file still set the field);
    ``choices`` are matched in any case; ``secret`` values are never echoed in an error.
    """
    metadata = {"setting": {"flag": flag, "help": help, "metavar": metavar, "choices": choices, "check": check,
                            "secret": secret}}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


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
        None, flag="--quantize", choices=("int8", "int8-torchao"),
        help="weight-only int8 for this node's decoder layers: a quarter of float32's bytes (int8: PyTorch's "
        "int8 kernel in bfloat16, fast on CPU; int8-torchao: torchao's own, any device, slow on CPU)")
    prefix_reuse: str = setting(
        "shared", flag="--prefix-reuse", choices=("shared", "client", "off"),
        help="as head, start a request from a session the mesh already holds when its prompt begins with that "
        "session's tokens: shared (any client's; default), client (only the same client's: its OpenAI 'user', "
        "else its address; a cached prefix answers faster, which another client could time), or off")
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
        "covers its layers, how long to wait for one (e.g. a restart) before the generation fails (default 30)",
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


_KIND_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               list: "a list of strings"}
_TRUE_WORDS, _FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One configuration field as every source sees it: flag, environment variable, TOML type and check."""

    name: str
    kind: type  # str, int, float, bool, or list (of str)
    default: object
    flag: str | None
    help: str
    metavar: str | None
    choices: tuple[str, ...]
    check: Check | None
    secret: bool

    @property
    def env_var(self) -> str:
        """The environment variable that sets this field: ``MESHNET_`` and the field name in capitals."""
        return f"MESHNET_{self.name.upper()}"

    @property
    def kind_name(self) -> str:
        """The field's type in words, for error messages."""
        return _KIND_NAMES[self.kind]

    def argparse_options(self) -> dict:
        """Keyword arguments of ``add_argument(self.flag, ...)``.

        The default stays None, so only options the user gave reach :func:`load_config`. A bool flag
        sets the opposite of the default (``--no-kv-cache``), a list flag repeats (``--peer``).
        """
        options: dict = {"dest": self.name, "default": None, "help": self.help}
        if self.kind is bool:
            return options | {"action": "store_const", "const": not self.default}
        if self.kind is list:
            options["action"] = "append"
        elif self.kind in (int, float):
            options["type"] = self.kind
        if self.choices:
            options |= {"choices": self.choices, "type": str.lower}
        if self.metavar:
            options["metavar"] = self.metavar
        return options

    def parse_text(self, text: str):
        """The value of an environment variable's text; ValueError when it is not of the field's type."""
        text = text.strip()
        if self.kind is list:  # space and/or comma separated
            return [part for part in text.replace(",", " ").split() if part]
        if self.kind is bool:
            if text.lower() not in _TRUE_WORDS + _FALSE_WORDS:
                raise ValueError(text)
            return text.lower() in _TRUE_WORDS
        return self.kind(text)

    def has_type(self, value) -> bool:
        """Whether ``value`` (from the TOML file or a caller) is of this field's type; ints count as floats."""
        if isinstance(value, bool):  # a bool is an int to Python, never to a config file
            return self.kind is bool
        if self.kind is float:
            return isinstance(value, int | float)
        if self.kind is list:
            return isinstance(value, list) and all(isinstance(item, str) for item in value)
        return isinstance(value, self.kind)

    def problem(self, value) -> str | None:
        """What is wrong with a typed value for this field ("must be ..."), or None when it can be used."""
        if self.kind is float and not math.isfinite(value):
            return "must be a finite number"
        if self.kind is str and not value.strip():
            return "must not be empty"
        if self.choices and value.lower() not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        return self.check(value) if self.check else None

    def normalized(self, value):
        """The value as NodeConfig holds it: floats as float, choices in lower case."""
        if self.kind is float:
            return float(value)
        if self.choices:
            return value.lower()
        return value


def _kind(annotation) -> type:
    """The one type a field holds: int for ``int | None``, list for ``list[str]``."""
    if typing.get_origin(annotation) is list:
        return list
    return next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)


def _settings() -> tuple[Setting, ...]:
    hints = typing.get_type_hints(NodeConfig)
    return tuple(
        Setting(name=f.name, kind=_kind(hints[f.name]),
                default=f.default if f.default is not MISSING else f.default_factory(), **f.metadata["setting"])
        for f in fields(NodeConfig)
    )


SETTINGS: tuple[Setting, ...] = _settings()  # every field of NodeConfig, in declaration order
_BY_NAME = {s.name: s for s in SETTINGS}


def default_config_path() -> Path:
    """``meshd.toml`` in the user's platformdirs config folder, the file read when none is named."""
    return Path(platformdirs.user_config_dir("meshnet")) / "meshd.toml"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names where it came from."""


def load_config(cli: dict, environ: Mapping[str, str] = os.environ, path: Path | None = None) -> NodeConfig:
    """Merge the sources in precedence order, then check every value that was given, once.

    ``cli`` maps field names to the options the user gave (None: not given). ``path`` is the TOML
    file; without it ``MESHNET_CONFIG`` names it, else :func:`default_config_path`. A bad value is a
    one-line :class:`ConfigError` naming its source: the file and key, the variable, or the flag.
    """
    path = path or (Path(environ["MESHNET_CONFIG"]) if environ.get("MESHNET_CONFIG") else default_config_path())
    # field name -> (value, where it came from); a later source replaces an earlier one
    sources = (_from_cli(cli), _from_environ(environ), _from_toml(path))  # highest precedence first
    given = sources[2] | sources[1] | sources[0]
    for name, (value, source) in given.items():
        setting = _BY_NAME[name]
        problem = setting.problem(value)
        if problem:
            raise ConfigError(f"{source} {problem}" + ("" if setting.secret else f", got {value!r}"))
    given = _one_api_key(given, sources)
    return NodeConfig(**{name: _BY_NAME[name].normalized(value) for name, (value, _) in given.items()})


# the API key's names: the first is the field that holds it; the others set it too (the file by its content)
API_KEY_NAMES = ("api_key", "token", "api_key_file")


def _one_api_key(given: dict, sources: tuple[dict, ...]) -> dict:
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


def _from_toml(path: Path) -> dict[str, tuple[object, str]]:
    if not path.exists():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, OSError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = sorted(set(data) - set(_BY_NAME))
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown}; known keys are {sorted(_BY_NAME)}")
    for key, value in data.items():
        if not _BY_NAME[key].has_type(value):
            raise ConfigError(f"{path}: {key} must be {_BY_NAME[key].kind_name}, got {value!r}")
    return {key: (value, f"{path}: {key}") for key, value in data.items()}


def _from_environ(environ: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    given = {}
    for setting in SETTINGS:
        text = environ.get(setting.env_var, "")
        if not text.strip():  # a blank variable is an unset one
            continue
        try:
            given[setting.name] = (setting.parse_text(text), setting.env_var)
        except ValueError:
            shown = "" if setting.secret else f"={text!r}"
            expected = "one of " + ", ".join(_TRUE_WORDS + _FALSE_WORDS) if setting.kind is bool else setting.kind_name
            raise ConfigError(f"{setting.env_var}{shown} is not {expected}") from None
    return given


def _from_cli(cli: dict) -> dict[str, tuple[object, str]]:
    given = {}
    for name, value in cli.items():
        if value is None:  # not given
            continue
        setting = _BY_NAME.get(name)
        if setting is None:
            raise ConfigError(f"unknown option {name!r}")
        source = setting.flag or name
        if not setting.has_type(value):
            raise ConfigError(f"{source} must be {setting.kind_name}, got {value!r}")
        if setting.kind is list:  # a repeated option, each maybe a comma-separated list
            value = [part.strip() for item in value for part in item.split(",") if part.strip()]
        given[name] = (value, source)
    return given


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
