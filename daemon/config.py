"""meshd's configuration, with one precedence order:

    command line  >  environment (MESHNET_*)  >  TOML file  >  defaults

The TOML file is ``meshd.toml`` in the platformdirs config folder (or the file
named by ``--config`` / ``MESHNET_CONFIG``); its keys are the field names below.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

import platformdirs

from daemon.api import TOKEN_PATTERN, TOKEN_RULE

DEFAULT_PORT = 7070


@dataclass
class NodeConfig:
    model: str | None = None  # None: the built-in default model
    layers: str | None = None  # inclusive "A-B"; None: every layer
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    peers: list[str] = field(default_factory=list)
    kv_cache: bool = True
    threads: int | None = None  # None: the machine's cores shared among the daemons on this host
    kv_ttl_seconds: float = 600.0
    kv_max_sessions: int = 8
    kv_max_bytes: int | None = None
    wire_dtype: str = "float32"
    max_tokens_default: int = 256
    log_level: str = "info"
    public_url: str | None = None  # how peers reach this node; default http://host:port
    route_explore: float = 0.1  # share of new generations planned with randomised costs, to re-measure
    failover_wait_seconds: float = 30.0  # how long a generation waits for a route after a hop fails
    hop_timeout_seconds: float = 10.0  # a one-token step must answer within this (longer steps get more)
    token: str | None = None  # shared mesh token: every endpoint but /health needs "Authorization: Bearer <token>"
    max_body_bytes: int = 64 * 1024 * 1024  # larger request bodies are a 413
    max_tokens_cap: int = 4096  # the most a request may ask for (and never past the model's context)
    max_generations: int = 32  # concurrent generations this node heads; beyond: 429 with Retry-After
    shutdown_grace_seconds: float = 30.0  # on SIGTERM, how long running generations get to finish
    log_format: str = "auto"  # "text", "json", or "auto": text on a terminal, JSON otherwise

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"


# environment variable -> field, and how to read it
_ENV = {
    "MESHNET_MODEL": ("model", str),
    "MESHNET_LAYERS": ("layers", str),
    "MESHNET_HOST": ("host", str),
    "MESHNET_PORT": ("port", int),
    "MESHNET_PEERS": ("peers", lambda v: [p for p in v.replace(",", " ").split() if p]),
    "MESHNET_KV_CACHE": ("kv_cache", lambda v: v.strip().lower() not in ("0", "false", "no", "off")),
    "MESHNET_THREADS": ("threads", int),
    "MESHNET_KV_TTL_SECONDS": ("kv_ttl_seconds", float),
    "MESHNET_KV_MAX_SESSIONS": ("kv_max_sessions", int),
    "MESHNET_KV_MAX_BYTES": ("kv_max_bytes", int),
    "MESHNET_WIRE_DTYPE": ("wire_dtype", str),
    "MESHNET_LOG_LEVEL": ("log_level", str),
    "MESHNET_MAX_TOKENS_DEFAULT": ("max_tokens_default", int),
    "MESHNET_PUBLIC_URL": ("public_url", str),
    "MESHNET_ROUTE_EXPLORE": ("route_explore", float),
    "MESHNET_FAILOVER_WAIT_SECONDS": ("failover_wait_seconds", float),
    "MESHNET_HOP_TIMEOUT_SECONDS": ("hop_timeout_seconds", float),
    "MESHNET_TOKEN": ("token", str),
    "MESHNET_MAX_BODY_BYTES": ("max_body_bytes", int),
    "MESHNET_MAX_TOKENS_CAP": ("max_tokens_cap", int),
    "MESHNET_MAX_GENERATIONS": ("max_generations", int),
    "MESHNET_SHUTDOWN_GRACE_SECONDS": ("shutdown_grace_seconds", float),
    "MESHNET_LOG_FORMAT": ("log_format", str),
}


def default_config_path() -> Path:
    return Path(platformdirs.user_config_dir("meshnet")) / "meshd.toml"


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names where it came from."""


def load_config(cli: dict, environ: os._Environ | dict = os.environ, path: Path | None = None) -> NodeConfig:
    """Merge the sources in precedence order. ``cli`` holds only options the user gave."""
    names = {f.name for f in fields(NodeConfig)}
    merged: dict = {}
    path = path or (Path(environ["MESHNET_CONFIG"]) if environ.get("MESHNET_CONFIG") else default_config_path())
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, OSError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{path}: unknown keys {unknown}; known keys are {sorted(names)}")
        for key, value in data.items():
            _check_toml_type(path, key, value)
        merged.update(data)
    for var, (name, parse) in _ENV.items():
        if environ.get(var, "").strip():
            try:
                merged[name] = parse(environ[var])
            except ValueError:
                raise ConfigError(f"{var}={environ[var]!r} is not a valid {name}") from None
    merged.update({k: v for k, v in cli.items() if v is not None})
    config = NodeConfig(**merged)
    if config.wire_dtype not in ("float32", "float16", "bfloat16"):
        raise ConfigError(f"wire dtype must be float32, float16 or bfloat16, got {config.wire_dtype!r}")
    if config.threads is not None and config.threads < 1:
        raise ConfigError("threads must be at least 1")
    if not 0.0 <= config.route_explore <= 1.0:
        raise ConfigError(f"route explore must be between 0 and 1, got {config.route_explore}")
    if not 0.0 <= config.failover_wait_seconds <= 3600:
        raise ConfigError(f"failover wait must be between 0 and 3600 seconds, got {config.failover_wait_seconds}")
    if not 0.1 <= config.hop_timeout_seconds <= 3600:
        raise ConfigError(f"hop timeout must be between 0.1 and 3600 seconds, got {config.hop_timeout_seconds}")
    if config.token is not None and not TOKEN_PATTERN.fullmatch(config.token):
        raise ConfigError(f"the mesh token must be {TOKEN_RULE}")
    if config.max_body_bytes < 1024:
        raise ConfigError(f"max body bytes must be at least 1024, got {config.max_body_bytes}")
    if config.max_tokens_cap < 1:
        raise ConfigError(f"max tokens cap must be at least 1, got {config.max_tokens_cap}")
    if config.max_generations < 1:
        raise ConfigError(f"max generations must be at least 1, got {config.max_generations}")
    if not 0.0 <= config.shutdown_grace_seconds <= 3600:
        raise ConfigError(f"shutdown grace must be between 0 and 3600 seconds, got {config.shutdown_grace_seconds}")
    if config.log_format not in ("auto", "text", "json"):
        raise ConfigError(f"log format must be auto, text or json, got {config.log_format!r}")
    return config


_FIELD_TYPES = {
    "model": (str,), "layers": (str,), "host": (str,), "port": (int,), "peers": (list,), "kv_cache": (bool,),
    "threads": (int,), "kv_ttl_seconds": (int, float), "kv_max_sessions": (int,), "kv_max_bytes": (int,),
    "wire_dtype": (str,), "max_tokens_default": (int,), "log_level": (str,), "public_url": (str,),
    "route_explore": (int, float), "failover_wait_seconds": (int, float), "hop_timeout_seconds": (int, float),
    "token": (str,), "max_body_bytes": (int,), "max_tokens_cap": (int,), "max_generations": (int,),
    "shutdown_grace_seconds": (int, float), "log_format": (str,),
}

def _check_toml_type(path: Path, key: str, value) -> None:
    expected = _FIELD_TYPES[key]
    ok = isinstance(value, expected) and (bool in expected or not isinstance(value, bool))
    if key == "peers":
        ok = ok and all(isinstance(p, str) for p in value)
    if not ok:
        names = " or ".join(t.__name__ for t in expected)
        raise ConfigError(f"{path}: {key} must be {names}, got {value!r}")


def default_threads(config: NodeConfig) -> int:
    """Share the cores among the daemons on this host, so co-located daemons never oversubscribe.

    Daemons on one host are this node plus its peers on a loopback address. One
    pipeline step runs one node at a time, but OpenMP workers that spin while
    another process computes slow both by 3-5x; a fair share avoids that.
    """
    local_peers = sum(1 for p in config.peers if any(h in p for h in ("127.0.0.1", "localhost", "[::1]")))
    return max(1, host_cores() // (1 + local_peers))


def host_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the node on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
