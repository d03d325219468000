"""meshd on the command line: bad models and bad options end with a message, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from daemon.cli import _serve_parser, main
from daemon.config import SETTINGS, load_config


def meshd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("model, expected", [
    ("/no/such/model", "no such file"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "hub"),
])
def test_a_model_that_cannot_be_had_is_a_clear_error(model, expected):
    result = meshd("--model", model, "--port", "1")
    assert result.returncode == 1
    assert "meshd: error:" in result.stderr and expected in result.stderr.lower()
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_layers_outside_the_model_are_refused(tiny_model):
    result = meshd("--model", str(tiny_model("llama")), "--layers", "2-9")
    assert result.returncode == 2
    assert "--layers" in result.stderr and "last layer 3" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def meshd_main(tmp_path, monkeypatch, capsys):
    """``meshd_main(*args, env={...})`` -> (exit code, stderr): meshd's ``main`` run in this process, with only
    ``env`` of the MESHNET_* variables set and no config file, as a clean shell would run it."""

    def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        for name in [name for name in os.environ if name.startswith("MESHNET_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("HOME", str(tmp_path))
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / ".config"))
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        code = main(list(args))
        return code, capsys.readouterr().err

    return run


def test_a_bad_environment_value_names_the_variable(meshd_main):
    returncode, stderr = meshd_main(env={"MESHNET_PORT": "seventy"})
    assert returncode == 2 and "MESHNET_PORT" in stderr


@pytest.mark.parametrize("env", [{"MESHNET_LOG_LEVEL": "verbose"}, {"MESHNET_KV_TTL_SECONDS": "0"},
                                 {"MESHNET_KV_MAX_SESSIONS": "0"}, {"MESHNET_PORT": "65536"}])
def test_a_bad_environment_value_is_one_line_not_a_traceback(meshd_main, env):
    returncode, stderr = meshd_main(env=env)
    assert returncode == 2
    assert "Traceback" not in stderr
    assert stderr.startswith("meshd: error: ") and stderr.count("\n") == 1, stderr
    assert next(iter(env)) in stderr


@pytest.mark.parametrize("args", [["--kv-ttl", "nan"], ["--port", "0"], ["--layers", "9-2"], ["--peer", "ftp://x"]])
def test_a_bad_option_value_is_one_line_not_a_traceback(meshd_main, args):
    returncode, stderr = meshd_main(*args)
    assert returncode == 2
    assert "Traceback" not in stderr
    assert stderr.startswith(f"meshd: error: {args[0]} ") and stderr.count("\n") == 1, stderr


def test_a_bad_value_ends_the_meshd_process_with_one_line_and_no_traceback(tmp_path):
    # the cases above run main() in this process; this one runs the real command, from start to exit
    result = subprocess.run([sys.executable, "-m", "daemon.cli"], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MESHNET_PORT": "65536"})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("meshd: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "MESHNET_PORT" in result.stderr


def test_every_meshd_option_comes_from_the_config_table():
    options = {action.option_strings[-1]: action.dest for action in _serve_parser()._actions}
    special = {"--help": "help", "--version": "version", "--config": "config"}
    assert options == special | {s.flag: s.name for s in SETTINGS if s.flag}
    # fields without a flag are set by the environment or the file only, on purpose
    assert [s.name for s in SETTINGS if s.flag is None] == ["max_tokens_default"]


def test_options_not_given_stay_none_so_the_environment_can_win():
    args = vars(_serve_parser().parse_args([]))
    assert args == dict.fromkeys([s.name for s in SETTINGS if s.flag] + ["config"])


KEY_FILE = Path(tempfile.mkdtemp(prefix="meshnet-test-")) / "api-key"  # --api-key-file reads it
KEY_FILE.write_text("f" * 16 + "\n")

OPTION_CASES = [
    (["--model", "/m"], "model", "/m"),
    (["--layers", "0-14"], "layers", "0-14"),
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--port", "8001"], "port", 8001),
    (["--peer", "http://127.0.0.1:7071", "--peer", "10.0.0.2:7072"], "peers",
     ["http://127.0.0.1:7071", "10.0.0.2:7072"]),
    (["--no-kv-cache"], "kv_cache", False),
    (["--threads", "3"], "threads", 3),
    (["--kv-ttl", "12.5"], "kv_ttl_seconds", 12.5),
    (["--kv-max-sessions", "3"], "kv_max_sessions", 3),
    (["--kv-max-bytes", "4096"], "kv_max_bytes", 4096),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--device", "cuda:0"], "device", "cuda:0"),
    (["--quantize", "int8"], "quantize", "int8"),
    (["--wire-dtype", "float16"], "wire_dtype", "float16"),
    (["--prefix-reuse", "client"], "prefix_reuse", "client"),
    (["--log-level", "warning"], "log_level", "warning"),
    (["--log-level", "DEBUG"], "log_level", "debug"),
    (["--public-url", "http://node:9"], "public_url", "http://node:9"),
    (["--route-explore", "0"], "route_explore", 0.0),
    (["--failover-wait", "5"], "failover_wait_seconds", 5.0),
    (["--hop-timeout", "2.5"], "hop_timeout_seconds", 2.5),
    (["--token", "t" * 16], "token", "t" * 16),
    (["--max-body-bytes", "2048"], "max_body_bytes", 2048),
    (["--max-tokens-cap", "100"], "max_tokens_cap", 100),
    (["--max-generations", "4"], "max_generations", 4),
    (["--max-batch", "1"], "max_batch", 1),
    (["--step-tokens", "64"], "step_tokens", 64),
    (["--tune-kernels", "off"], "tune_kernels", "off"),
    (["--shutdown-grace", "0"], "shutdown_grace_seconds", 0.0),
    (["--log-format", "json"], "log_format", "json"),
    (["--api-key", "k" * 16], "api_key", "k" * 16),
    (["--api-key-file", str(KEY_FILE)], "api_key_file", str(KEY_FILE)),
    (["--allowed-origins", "https://a.example,http://b:8", "--allowed-origins", "*"], "allowed_origins",
     ["https://a.example", "http://b:8", "*"]),
    (["--max-model-len", "512"], "max_model_len", 512),
    (["--chat-template", "/t.jinja"], "chat_template", "/t.jinja"),
    (["--ssl-certfile", "/c.pem"], "ssl_certfile", "/c.pem"),
    (["--ssl-keyfile", "/k.pem"], "ssl_keyfile", "/k.pem"),
    (["--ssl-ca-file", "/ca.pem"], "ssl_ca_file", "/ca.pem"),
    (["--served-model-name", "smol", "--served-model-name", "gpt-4o-mini"], "served_model_name",
     ["smol", "gpt-4o-mini"]),
    (["--draft-model", "ngram"], "draft_model", "ngram"),
    (["--draft-max", "6"], "draft_max", 6),
    (["--draft-dtype", "float32"], "draft_dtype", "float32"),
    (["--draft-quantize", "int8"], "draft_quantize", "int8"),
]


def test_every_flag_has_an_option_case():
    assert {argv[0] for argv, _, _ in OPTION_CASES} == {s.flag for s in SETTINGS if s.flag}


@pytest.mark.parametrize("argv, field, value", OPTION_CASES)
def test_each_option_sets_its_field(tmp_path, argv, field, value):
    args = vars(_serve_parser().parse_args(argv))
    del args["config"]
    assert getattr(load_config(args, {}, tmp_path / "absent.toml"), field) == value


@pytest.mark.parametrize("argv", [["--log-level", "verbose"], ["--wire-dtype", "int8"], ["--port", "x"]])
def test_argparse_refuses_what_it_can_check(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _serve_parser().parse_args(argv)
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.slow
def test_a_busy_port_is_a_clear_error(tiny_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = meshd("--model", str(tiny_model("llama")), "--port", str(port))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_meshd_runs_on_uvloop_unless_told_otherwise(monkeypatch):
    import uvloop

    from daemon.server.loop import loop_factory

    monkeypatch.delenv("MESHNET_EVENT_LOOP", raising=False)
    assert loop_factory() is uvloop.new_event_loop
    monkeypatch.setenv("MESHNET_EVENT_LOOP", "asyncio")
    assert loop_factory() is None  # asyncio's own loop, to compare the two


# ---- meshd fetch-model --json: the answer programs (the console's local mesh) read -------------------


def test_fetch_model_json_answers_the_folder_and_still_tells_people(default_model, capsys):
    folder = default_model.resolve()
    assert main(["fetch-model", "--model", str(folder), "--json"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and json.loads(out) == {"folder": str(folder)}
    assert f"meshd: the model is ready in {folder}\n" in err


def test_fetch_model_json_answers_a_gguf_s_layer_count(default_model, capsys):
    from daemon.model.source import default_gguf_path

    gguf = default_gguf_path()  # the built-in model's own GGUF, kept once it was fetched
    assert main(["fetch-model", "--model", str(gguf), "--layer-count", "--json"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and json.loads(out) == {"layers": 30}
    assert err.endswith(f"meshd: {gguf.name} has 30 layers\n")


def test_fetch_model_without_json_says_it_only_in_prose(default_model, capsys):
    assert main(["fetch-model", "--model", str(default_model)]) == 0
    assert capsys.readouterr().out == ""


def test_a_node_loads_with_the_collector_off_and_serves_with_it_on(monkeypatch):
    """Loading makes millions of lasting objects: the cyclic collector is off meanwhile, and on again (with what
    loading made frozen out of its passes) once the node serves, or once a refused load has said why."""
    import gc

    from daemon import cli

    seen = []

    def load_node(argv):
        seen.append(("loading", gc.isenabled()))
        if argv == ["--refused"]:
            raise cli.Refused("no", 2)
        return "node"

    monkeypatch.setattr(cli, "load_node", load_node)
    monkeypatch.setattr(cli, "node_app", lambda node: f"app of {node}")
    monkeypatch.setattr(cli, "run", lambda app, node: seen.append(("serving", gc.isenabled(), app)) or 0)
    try:
        assert cli.serve([]) == 0
        assert cli.serve(["--refused"]) == 2
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert seen == [("loading", False), ("serving", True, "app of node"), ("loading", False)]
    assert gc.isenabled()


@pytest.mark.slow  # a fresh process loading a model: 6 s
def test_torch_is_first_imported_after_meshd_has_set_openmps_environment(tiny_model):
    """libgomp reads ``GOMP_SPINCOUNT`` and ``OMP_NUM_THREADS`` once, as torch loads it: meshd sets them before
    anything it loads imports torch."""
    program = """
import os, sys
seen = {}
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "torch" not in seen:
            seen["torch"] = (os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_NUM_THREADS"))
        return None
sys.meta_path.insert(0, Watch())
from daemon.cli import GOMP_SPINS, load_node
load_node(sys.argv[1:])
print(seen["torch"] == (str(GOMP_SPINS), "1"))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    result = subprocess.run([sys.executable, "-c", program, "--model", str(tiny_model("llama")), "--threads", "1"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "True"
