"""Unit tests of meshd's configuration (``daemon.config``) and the layer-range syntax (``daemon.api``)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import fields
from pathlib import Path

import pytest

from daemon import config as config_module
from daemon import host
from daemon.api import format_layers, parse_layers
from daemon.config import DEFAULT_PORT, SETTINGS, NodeConfig, default_threads, load_config
from daemon.settings import ConfigError


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
    assert cfg.wire_dtype is None and cfg.dtype == "auto" and cfg.device == "auto"  # the wire: the compute dtype
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
    ("MESHNET_PREFIX_REUSE", "prefix_reuse", "client", "client"),
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


# ---- the table of fields drives every source -----------------------------------------------------

# a file holding a usable API key, for the api_key_file cases
KEY_FILE = Path(tempfile.mkdtemp(prefix="meshnet-test-")) / "api-key"
KEY_FILE.write_text("f" * 16 + "\n")

# a usable value of every field, none of them its default
VALID = {
    "model": "/models/x", "layers": "0-14", "host": "0.0.0.0", "port": 8001,
    "peers": ["http://127.0.0.1:7071", "10.0.0.3:7072", "http://[::1]:7073"], "kv_cache": False, "threads": 3,
    "kv_ttl_seconds": 12.5, "kv_max_sessions": 3, "kv_max_bytes": 0, "dtype": "bfloat16", "device": "cuda:1",
    "quantize": "int8", "prefix_reuse": "off", "draft_model": "ngram", "draft_max": 8, "draft_dtype": "float32",
    "draft_quantize": "int8", "wire_dtype": "bfloat16",
    "max_tokens_default": 64, "log_level": "debug", "public_url": "https://node.example:9",
    "route_explore": 0.5, "failover_wait_seconds": 5.0, "hop_timeout_seconds": 2.5, "token": "t" * 16,
    "max_body_bytes": 2048, "max_tokens_cap": 100, "max_generations": 4, "max_batch": 1, "step_tokens": 16,
    "tune_kernels": "off", "shutdown_grace_seconds": 0.0,
    "log_format": "json",
    "api_key": "k" * 16, "api_key_file": str(KEY_FILE), "allowed_origins": ["https://app.example.com", "*"],
    "max_model_len": 64, "chat_template": "/templates/chat.jinja", "ssl_certfile": "/tls/node.pem",
    "ssl_keyfile": "/tls/node.key", "ssl_ca_file": "/tls/ca.pem",
    "served_model_name": ["smol", "gpt-4o-mini"],
}

# values every field must refuse, each from the source it can come from: "env" (text), "cli" or "toml" (typed)
INVALID = {
    "model": [("cli", ""), ("toml", "  ")],
    "layers": [("env", "a-b"), ("env", "14-0"), ("cli", "0-x"), ("toml", "")],
    "host": [("cli", ""), ("toml", " ")],
    "port": [("env", "seventy"), ("env", "0"), ("env", "65536"), ("cli", -1), ("toml", 70000)],
    "peers": [("env", "ftp://a:1"), ("cli", ["http://a:1", "http://b:99999"]), ("toml", ["http://"])],
    "kv_cache": [("env", "maybe"), ("toml", "no")],
    "threads": [("env", "2.5"), ("env", "0"), ("cli", -2), ("toml", 0)],
    "kv_ttl_seconds": [("env", "0"), ("env", "-1"), ("env", "nan"), ("cli", float("inf")), ("toml", 0)],
    "kv_max_sessions": [("env", "0"), ("env", "many"), ("cli", -1), ("toml", 0)],
    "kv_max_bytes": [("env", "-1"), ("env", "1GB"), ("cli", -5), ("toml", -1)],
    "dtype": [("env", "int8"), ("cli", "float64"), ("toml", "fp16")],
    "device": [("env", "gpu"), ("env", "cuda:"), ("cli", "CUDA"), ("toml", "tpu")],
    "quantize": [("env", "int3"), ("cli", "fp8"), ("toml", "")],
    "prefix_reuse": [("env", "always"), ("cli", "user"), ("toml", "")],
    "draft_model": [("cli", ""), ("toml", " ")],
    "draft_max": [("env", "0"), ("env", "33"), ("env", "four"), ("cli", -1), ("toml", 0)],
    "draft_dtype": [("env", "int8"), ("cli", "float64"), ("toml", "")],
    "draft_quantize": [("env", "int4"), ("cli", "int8-torchao"), ("toml", "")],
    "wire_dtype": [("env", "int8"), ("cli", "int8"), ("toml", "float64")],
    "max_tokens_default": [("env", "0"), ("env", "lots"), ("cli", -1), ("toml", 0)],
    "log_level": [("env", "verbose"), ("cli", "trace"), ("toml", "critical")],
    "public_url": [("env", "ftp://node"), ("cli", "http://"), ("toml", "http://node:0")],
    "route_explore": [("env", "1.5"), ("env", "-0.1"), ("env", "nan"), ("cli", float("inf")), ("toml", 2)],
    "failover_wait_seconds": [("env", "-1"), ("env", "3601"), ("env", "inf"), ("cli", float("nan"))],
    "hop_timeout_seconds": [("env", "0"), ("env", "0.05"), ("env", "3601"), ("cli", float("-inf"))],
    "token": [("env", "short"), ("cli", "has a space in it!"), ("toml", "x" * 257)],
    "max_body_bytes": [("env", "1023"), ("env", "64MiB"), ("cli", 0), ("toml", -1)],
    "max_tokens_cap": [("env", "0"), ("cli", -4), ("toml", 0)],
    "max_generations": [("env", "0"), ("cli", -1), ("toml", 0)],
    "max_batch": [("env", "0"), ("cli", -2), ("toml", 0)],
    "step_tokens": [("env", "8"), ("cli", 15), ("toml", "many")],
    "tune_kernels": [("env", "maybe"), ("cli", "auto"), ("toml", "")],
    "shutdown_grace_seconds": [("env", "-1"), ("env", "3601"), ("env", "nan"), ("toml", 4000)],
    "log_format": [("env", "xml"), ("cli", "yaml"), ("toml", "")],
    "api_key": [("env", "short"), ("cli", "has a space in it!"), ("toml", "x" * 257)],
    "api_key_file": [("env", "/no/such/key-file"), ("cli", ""), ("toml", " ")],
    "allowed_origins": [("env", "ftp://app"), ("cli", ["https://app.example.com/path"]), ("toml", ["app.example"])],
    "max_model_len": [("env", "0"), ("env", "long"), ("cli", 1), ("toml", -1)],
    "chat_template": [("cli", ""), ("toml", " ")],
    "ssl_certfile": [("cli", ""), ("toml", " ")],
    "ssl_keyfile": [("cli", ""), ("toml", " ")],
    "ssl_ca_file": [("cli", ""), ("toml", " ")],
    "served_model_name": [("cli", ["has space"]), ("toml", [""]), ("toml", ["x" * 257])],
}

# a value of the wrong type for each kind of field: the TOML file must refuse it
WRONG_TYPE = {str: 5, int: "5", float: "5.0", bool: "no", list: "http://a:1"}


def env_text(value) -> str:
    """How a value is written in a MESHNET_* variable."""
    if isinstance(value, list):
        return ", ".join(value)
    if isinstance(value, bool):
        return "yes" if value else "off"
    return str(value)


def test_the_table_has_every_field_in_order():
    assert [s.name for s in SETTINGS] == [f.name for f in fields(NodeConfig)]
    assert {s.name: s.default for s in SETTINGS} == {f.name: getattr(NodeConfig(), f.name) for f in fields(NodeConfig)}


def test_the_table_covers_every_field_in_these_tests():
    # a new field must come with usable and unusable values here, so the tests below cover it
    assert set(VALID) == set(INVALID) == {s.name for s in SETTINGS}


def test_environment_variable_names_are_unchanged():
    assert [s.env_var for s in SETTINGS] == [
        "MESHNET_MODEL", "MESHNET_LAYERS", "MESHNET_HOST", "MESHNET_PORT", "MESHNET_PEERS", "MESHNET_KV_CACHE",
        "MESHNET_THREADS", "MESHNET_KV_TTL_SECONDS", "MESHNET_KV_MAX_SESSIONS", "MESHNET_KV_MAX_BYTES", "MESHNET_DTYPE",
        "MESHNET_DEVICE", "MESHNET_QUANTIZE", "MESHNET_PREFIX_REUSE", "MESHNET_DRAFT_MODEL", "MESHNET_DRAFT_MAX",
        "MESHNET_DRAFT_DTYPE", "MESHNET_DRAFT_QUANTIZE",
        "MESHNET_WIRE_DTYPE", "MESHNET_MAX_TOKENS_DEFAULT", "MESHNET_LOG_LEVEL", "MESHNET_PUBLIC_URL",
        "MESHNET_ROUTE_EXPLORE", "MESHNET_FAILOVER_WAIT_SECONDS", "MESHNET_HOP_TIMEOUT_SECONDS", "MESHNET_TOKEN",
        "MESHNET_MAX_BODY_BYTES", "MESHNET_MAX_TOKENS_CAP", "MESHNET_MAX_BATCH", "MESHNET_TUNE_KERNELS",
        "MESHNET_STEP_TOKENS",
        "MESHNET_MAX_GENERATIONS",
        "MESHNET_SHUTDOWN_GRACE_SECONDS", "MESHNET_LOG_FORMAT",
        "MESHNET_API_KEY", "MESHNET_API_KEY_FILE", "MESHNET_ALLOWED_ORIGINS", "MESHNET_MAX_MODEL_LEN",
        "MESHNET_CHAT_TEMPLATE", "MESHNET_SSL_CERTFILE", "MESHNET_SSL_KEYFILE", "MESHNET_SSL_CA_FILE",
        "MESHNET_SERVED_MODEL_NAME",
    ]


def test_the_defaults_pass_their_own_checks():
    assert all(s.problem(s.default) is None for s in SETTINGS if s.default is not None)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_field_is_read_from_its_environment_variable(no_file, setting):
    value = VALID[setting.name]
    assert value != setting.default
    assert getattr(load_config({}, {setting.env_var: env_text(value)}, no_file), setting.name) == value


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_field_is_a_toml_key(tmp_path, setting):
    value = VALID[setting.name]
    path = write_toml(tmp_path, f"{setting.name} = {json.dumps(value)}\n")
    assert getattr(load_config({}, {}, path), setting.name) == value


@pytest.mark.parametrize(("setting", "wrong"),
                         [(s, WRONG_TYPE[s.kind]) for s in SETTINGS]
                         + [(s, True) for s in SETTINGS if s.kind in (int, float)],  # a bool is no number
                         ids=lambda case: case.name if hasattr(case, "name") else repr(case))
def test_every_field_checks_its_toml_type(tmp_path, setting, wrong):
    path = write_toml(tmp_path, f"{setting.name} = {json.dumps(wrong)}\n")
    with pytest.raises(ConfigError) as info:
        load_config({}, {}, path)
    assert str(info.value).startswith(f"{path}: {setting.name} must be {setting.kind_name}")


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_field_is_taken_from_the_command_line_dict(no_file, setting):
    assert getattr(load_config({setting.name: VALID[setting.name]}, {}, no_file), setting.name) == VALID[setting.name]


@pytest.mark.parametrize(("name", "source", "value"),
                         [(name, source, value) for name, cases in INVALID.items() for source, value in cases])
def test_every_invalid_value_is_a_one_line_error_naming_its_source(tmp_path, name, source, value):
    setting = next(s for s in SETTINGS if s.name == name)
    path = write_toml(tmp_path, f"{name} = {json.dumps(value)}\n" if source == "toml" else "")
    env = {setting.env_var: value} if source == "env" else {}
    cli = {name: value} if source == "cli" else {}
    with pytest.raises(ConfigError) as info:
        load_config(cli, env, path)
    message = str(info.value)
    assert "\n" not in message
    expected = {"env": setting.env_var, "cli": setting.flag or name, "toml": f"{path}: {name}"}[source]
    assert message.startswith(expected), message


def test_an_invalid_value_overridden_by_a_valid_one_is_not_checked(tmp_path):
    # checks apply to the merged value: a bad file value the environment replaces does not matter
    path = write_toml(tmp_path, "kv_ttl_seconds = 0\nport = 0\n")
    cfg = load_config({"port": 8001}, {"MESHNET_KV_TTL_SECONDS": "5"}, path)
    assert (cfg.kv_ttl_seconds, cfg.port) == (5.0, 8001)


def test_a_bad_token_is_never_echoed(no_file):
    secret = "a secret with spaces"
    with pytest.raises(ConfigError, match="MESHNET_TOKEN") as info:
        load_config({}, {"MESHNET_TOKEN": secret}, no_file)
    assert secret not in str(info.value)


@pytest.mark.parametrize("raw", ["DEBUG", "Warning", " error "])
def test_choices_match_in_any_case(no_file, raw):
    assert load_config({}, {"MESHNET_LOG_LEVEL": raw}, no_file).log_level == raw.strip().lower()


def test_toml_integers_are_read_as_floats_where_a_field_is_a_float(tmp_path):
    cfg = load_config({}, {}, write_toml(tmp_path, "kv_ttl_seconds = 30\nroute_explore = 1\n"))
    assert cfg.kv_ttl_seconds == 30.0 and isinstance(cfg.kv_ttl_seconds, float)
    assert cfg.route_explore == 1.0 and isinstance(cfg.route_explore, float)


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("ON", True), ("off", False), ("No", False)])
def test_kv_cache_words(no_file, raw, expected):
    assert load_config({}, {"MESHNET_KV_CACHE": raw}, no_file).kv_cache is expected


# ---- default_threads ---------------------------------------------------------------------------


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n: int) -> None:
        monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

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
    monkeypatch.setattr(host.os, "cpu_count", lambda: 64)
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


# ---- the API key and its older name --------------------------------------------------------------


def test_the_api_key_and_the_token_are_one_setting_in_precedence_order(tmp_path, no_file):
    a, b, c = "a" * 16, "b" * 16, "c" * 16
    cfg = load_config({"token": a}, {"MESHNET_API_KEY": b}, no_file)  # the command line wins, by either name
    assert cfg.api_key == cfg.token == a
    cfg = load_config({}, {"MESHNET_TOKEN": b}, write_toml(tmp_path, f'api_key = "{c}"\n'))
    assert cfg.api_key == cfg.token == b
    # a key file lower in the order is never read: the environment already gave the key
    path = write_toml(tmp_path, 'api_key_file = "/no/such/file"\n')
    assert load_config({}, {"MESHNET_API_KEY": b}, path).api_key == b
    assert load_config({}, {"MESHNET_API_KEY": a, "MESHNET_TOKEN": a}, no_file).api_key == a  # the same key twice


def test_the_api_key_file_gives_its_first_line(tmp_path, no_file):
    key_file = tmp_path / "key"
    key_file.write_text("\n  " + "k" * 20 + "  \nnot this line\n")
    cfg = load_config({"api_key_file": str(key_file)}, {}, no_file)
    assert cfg.api_key == cfg.token == "k" * 20 and cfg.api_key_file == str(key_file)
    with pytest.raises(ConfigError, match="different keys"):
        load_config({"api_key_file": str(key_file), "api_key": "z" * 16}, {}, no_file)
    key_file.write_text("secret words but far too loose\n")
    with pytest.raises(ConfigError, match="the key must be") as info:
        load_config({"api_key_file": str(key_file)}, {}, no_file)
    assert "secret" not in str(info.value)  # the key is never echoed


def test_allowed_origins_split_on_commas_from_every_source(tmp_path, no_file):
    want = ["https://a.example", "http://localhost:3000"]
    assert load_config({"allowed_origins": ["https://a.example,http://localhost:3000"]}, {}, no_file) \
        .allowed_origins == want
    assert load_config({}, {"MESHNET_ALLOWED_ORIGINS": "https://a.example, http://localhost:3000"}, no_file) \
        .allowed_origins == want
    assert load_config({}, {}, write_toml(tmp_path, f"allowed_origins = {json.dumps(want)}\n")).allowed_origins == want


def test_a_tls_node_advertises_https(no_file):
    cfg = load_config({"ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem", "port": 8443}, {}, no_file)
    assert cfg.url == "https://127.0.0.1:8443"
def test_served_model_names_repeat_or_come_comma_separated(tmp_path):
    no_file = tmp_path / "absent.toml"
    assert load_config({"served_model_name": ["a", "b"]}, {}, no_file).served_model_name == ["a", "b"]
    env = {"MESHNET_SERVED_MODEL_NAME": "smol,gpt-4o-mini"}
    assert load_config({}, env, no_file).served_model_name == ["smol", "gpt-4o-mini"]
    assert load_config({}, {}, no_file).served_model_name == []  # the model folder's name, decided by the node
