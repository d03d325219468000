"""Unit tests of meshd's configuration (``daemon.config``) and the layer-range syntax (``daemon.api``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon import config as config_module
from daemon.api import format_layers, parse_layers
from daemon.config import DEFAULT_PORT, ConfigError, NodeConfig, default_threads, load_config


@pytest.fixture
def no_file(tmp_path) -> Path:
    """A config path that does not exist: never read the user's real meshd.toml."""
    return tmp_path / "absent.toml"


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "meshd.toml"
    path.write_text(text)
    return path


# ---- defaults and precedence -----------------------------------------------------------------------


def test_defaults(no_file):
    cfg = load_config({}, {}, no_file)
    assert cfg == NodeConfig()
    assert cfg.port == DEFAULT_PORT == 7070
    assert cfg.host == "127.0.0.1"
    assert cfg.kv_cache is True and cfg.peers == [] and cfg.threads is None
    assert cfg.wire_dtype == "float32"
    assert cfg.url == "http://127.0.0.1:7070"


def test_toml_overrides_defaults(tmp_path):
    path = write_toml(tmp_path, 'port = 8001\nlayers = "0-14"\npeers = ["http://127.0.0.1:8002"]\n'
                                'kv_cache = false\nkv_ttl_seconds = 30.5\n')
    cfg = load_config({}, {}, path)
    assert cfg.port == 8001
    assert cfg.layers == "0-14"
    assert cfg.peers == ["http://127.0.0.1:8002"]
    assert cfg.kv_cache is False
    assert cfg.kv_ttl_seconds == 30.5
    assert cfg.host == "127.0.0.1"  # untouched fields keep their defaults


def test_env_overrides_toml(tmp_path):
    path = write_toml(tmp_path, 'port = 8001\nhost = "0.0.0.0"\nkv_cache = true\n')
    env = {"MESHNET_PORT": "8003", "MESHNET_KV_CACHE": "off", "MESHNET_PEERS": "http://a:1, http://b:2  http://c:3"}
    cfg = load_config({}, env, path)
    assert cfg.port == 8003
    assert cfg.kv_cache is False
    assert cfg.peers == ["http://a:1", "http://b:2", "http://c:3"]
    assert cfg.host == "0.0.0.0"  # from the file: no env var for it


def test_cli_overrides_env_and_toml(tmp_path):
    path = write_toml(tmp_path, 'port = 8001\nthreads = 2\nlog_level = "debug"\n')
    env = {"MESHNET_PORT": "8003", "MESHNET_THREADS": "3"}
    cfg = load_config({"port": 8005, "threads": None, "log_level": None}, env, path)
    assert cfg.port == 8005  # command line wins
    assert cfg.threads == 3  # None on the command line means "not given": env wins
    assert cfg.log_level == "debug"  # neither cli nor env: file wins


def test_cli_false_is_a_value(no_file):
    cfg = load_config({"kv_cache": False}, {"MESHNET_KV_CACHE": "1"}, no_file)
    assert cfg.kv_cache is False


def test_blank_env_values_are_ignored(tmp_path):
    path = write_toml(tmp_path, "port = 8001\n")
    cfg = load_config({}, {"MESHNET_PORT": "   ", "MESHNET_MODEL": ""}, path)
    assert cfg.port == 8001
    assert cfg.model is None


@pytest.mark.parametrize("var,field,raw,value", [
    ("MESHNET_MODEL", "model", "/models/x", "/models/x"),
    ("MESHNET_LAYERS", "layers", "15-29", "15-29"),
    ("MESHNET_HOST", "host", "0.0.0.0", "0.0.0.0"),
    ("MESHNET_THREADS", "threads", "6", 6),
    ("MESHNET_KV_TTL_SECONDS", "kv_ttl_seconds", "12.5", 12.5),
    ("MESHNET_KV_MAX_SESSIONS", "kv_max_sessions", "3", 3),
    ("MESHNET_KV_MAX_BYTES", "kv_max_bytes", "1048576", 1048576),
    ("MESHNET_WIRE_DTYPE", "wire_dtype", "bfloat16", "bfloat16"),
    ("MESHNET_LOG_LEVEL", "log_level", "warning", "warning"),
    ("MESHNET_PUBLIC_URL", "public_url", "http://node:9", "http://node:9"),
    ("MESHNET_KV_CACHE", "kv_cache", "no", False),
    ("MESHNET_KV_CACHE", "kv_cache", "FALSE", False),
    ("MESHNET_KV_CACHE", "kv_cache", "0", False),
    ("MESHNET_KV_CACHE", "kv_cache", "yes", True),
])
def test_each_env_variable(no_file, var, field, raw, value):
    cfg = load_config({}, {var: raw}, no_file)
    assert getattr(cfg, field) == value


def test_public_url_overrides_url(no_file):
    assert load_config({"host": "10.0.0.5", "port": 9000}, {}, no_file).url == "http://10.0.0.5:9000"
    assert load_config({"public_url": "http://mesh.example:80"}, {}, no_file).url == "http://mesh.example:80"


def test_meshnet_config_env_names_the_file(tmp_path):
    path = write_toml(tmp_path, "port = 8111\n")
    assert load_config({}, {"MESHNET_CONFIG": str(path)}).port == 8111


def test_explicit_path_beats_meshnet_config(tmp_path):
    path = write_toml(tmp_path, "port = 8111\n")
    other = tmp_path / "other.toml"
    other.write_text("port = 8222\n")
    assert load_config({}, {"MESHNET_CONFIG": str(other)}, path).port == 8111


def test_default_path_is_used_without_path_or_env(tmp_path, monkeypatch):
    path = write_toml(tmp_path, "port = 8333\n")
    monkeypatch.setattr(config_module, "default_config_path", lambda: path)
    assert load_config({}, {}).port == 8333
    assert config_module.default_config_path().name == "meshd.toml"


# ---- errors -----------------------------------------------------------------------------------


def test_unknown_toml_key_names_the_file_and_key(tmp_path):
    path = write_toml(tmp_path, "port = 8001\nprot = 8002\n")
    with pytest.raises(ConfigError) as info:
        load_config({}, {}, path)
    message = str(info.value)
    assert str(path) in message
    assert "prot" in message


def test_invalid_toml_names_the_file(tmp_path):
    path = write_toml(tmp_path, "port = = 1\n")
    with pytest.raises(ConfigError, match="meshd.toml"):
        load_config({}, {}, path)


@pytest.mark.parametrize("var,raw", [
    ("MESHNET_PORT", "seventy"),
    ("MESHNET_THREADS", "2.5"),
    ("MESHNET_KV_TTL_SECONDS", "soon"),
    ("MESHNET_KV_MAX_SESSIONS", "many"),
    ("MESHNET_KV_MAX_BYTES", "1GB"),
])
def test_bad_env_value_names_the_variable(no_file, var, raw):
    with pytest.raises(ConfigError) as info:
        load_config({}, {var: raw}, no_file)
    message = str(info.value)
    assert var in message
    assert raw in message


def test_bad_env_value_raises_even_when_cli_overrides(no_file):
    with pytest.raises(ConfigError, match="MESHNET_PORT"):
        load_config({"port": 8000}, {"MESHNET_PORT": "x"}, no_file)


@pytest.mark.parametrize("source", ["cli", "env", "toml"])
def test_bad_wire_dtype_from_any_source(tmp_path, source):
    path = write_toml(tmp_path, 'wire_dtype = "int8"\n' if source == "toml" else "")
    env = {"MESHNET_WIRE_DTYPE": "int8"} if source == "env" else {}
    cli = {"wire_dtype": "int8"} if source == "cli" else {}
    with pytest.raises(ConfigError, match="int8"):
        load_config(cli, env, path)


@pytest.mark.parametrize("threads", [0, -2])
def test_threads_must_be_positive(no_file, threads):
    with pytest.raises(ConfigError, match="threads"):
        load_config({"threads": threads}, {}, no_file)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---- the session cache variables (read here only; the store no longer reads the environment) --------


def test_kv_variables_are_read_and_explicit_options_win(no_file):
    env = {"MESHNET_KV_TTL_SECONDS": "120.5", "MESHNET_KV_MAX_SESSIONS": "3", "MESHNET_KV_MAX_BYTES": "4096"}
    cfg = load_config({}, env, no_file)
    assert (cfg.kv_ttl_seconds, cfg.kv_max_sessions, cfg.kv_max_bytes) == (120.5, 3, 4096)
    cfg = load_config({"kv_max_sessions": 9, "kv_max_bytes": None}, env, no_file)
    assert (cfg.kv_max_sessions, cfg.kv_max_bytes) == (9, 4096)
    defaults = load_config({}, {}, no_file)
    assert (defaults.kv_ttl_seconds, defaults.kv_max_sessions, defaults.kv_max_bytes) == (600.0, 8, None)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MESHNET_KV_TTL_SECONDS", "ten"),
        ("MESHNET_KV_TTL_SECONDS", "0"),
        ("MESHNET_KV_MAX_SESSIONS", "2.5"),
        ("MESHNET_KV_MAX_SESSIONS", "-1"),
        ("MESHNET_KV_MAX_BYTES", "lots"),
        ("MESHNET_KV_MAX_BYTES", "-1"),
        ("MESHNET_KV_TTL_SECONDS", "nan"),
        ("MESHNET_KV_TTL_SECONDS", "inf"),
    ],
)
def test_kv_variables_reject_bad_values_naming_the_variable(no_file, name, value):
    with pytest.raises(ValueError, match=name):
        load_config({}, {name: value}, no_file)


# ---- default_threads ---------------------------------------------------------------------------


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n: int) -> None:
        monkeypatch.setattr(config_module.os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    return set_cores


def test_default_threads_alone_uses_every_core(cores):
    cores(16)
    assert default_threads(NodeConfig()) == 16


@pytest.mark.parametrize("peers,expected", [
    (["http://127.0.0.1:7071"], 8),
    (["http://127.0.0.1:7071", "http://localhost:7072"], 5),  # 16 // 3
    (["http://127.0.0.1:7071", "http://localhost:7072", "http://[::1]:7073"], 4),
    (["http://10.0.0.2:7071", "http://node-b:7070"], 16),  # remote peers share nothing
    (["http://10.0.0.2:7071", "http://127.0.0.1:7072"], 8),
])
def test_default_threads_shares_cores_with_loopback_peers(cores, peers, expected):
    cores(16)
    assert default_threads(NodeConfig(peers=peers)) == expected


def test_default_threads_never_below_one(cores):
    cores(2)
    peers = [f"http://127.0.0.1:{7071 + i}" for i in range(5)]
    assert default_threads(NodeConfig(peers=peers)) == 1


def test_default_threads_uses_affinity_not_cpu_count(cores, monkeypatch):
    cores(3)
    monkeypatch.setattr(config_module.os, "cpu_count", lambda: 64)
    assert default_threads(NodeConfig()) == 3


# ---- layer ranges (daemon.api) ---------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("0-14", (0, 15)),
    ("15-29", (15, 30)),
    ("7", (7, 8)),
    ("0-0", (0, 1)),
    (" 3-5 ", (3, 6)),
])
def test_parse_layers(text, expected):
    assert parse_layers(text) == expected
    assert parse_layers(text, num_layers=30) == expected


@pytest.mark.parametrize("start,end,text", [(0, 15, "0-14"), (15, 30, "15-29"), (4, 5, "4-4")])
def test_format_layers_is_inclusive(start, end, text):
    assert format_layers(start, end) == text
    assert parse_layers(format_layers(start, end)) == (start, end)


@pytest.mark.parametrize("text", ["a-b", "1-x", "", "-", "-5", "1-2-3", "1..5", "1 - x", "0x1-2"])
def test_parse_layers_rejects_garbage(text):
    with pytest.raises(ValueError, match="look like 0-14"):
        parse_layers(text)


def test_parse_layers_rejects_reversed_range():
    with pytest.raises(ValueError, match="ends before it starts"):
        parse_layers("14-0")


@pytest.mark.parametrize("text", ["0-30", "29-30", "30"])
def test_parse_layers_rejects_past_last_layer(text):
    with pytest.raises(ValueError, match="last layer 29"):
        parse_layers(text, num_layers=30)
    # without a model size there is nothing to check against
    assert parse_layers(text)[1] == 31


def test_parse_layers_last_layer_is_allowed():
    assert parse_layers("0-29", num_layers=30) == (0, 30)


@pytest.mark.parametrize("line", ['port = "80x"', 'threads = "4"', 'kv_cache = "no"', 'peers = "http://a:1"'])
def test_toml_value_of_wrong_type_names_the_file(tmp_path, line):
    path = write_toml(tmp_path, line + "\n")
    with pytest.raises(ConfigError, match="meshd.toml"):
        load_config({}, {}, path)
