"""Server conventions (issue 16): the API key under its usual names, CORS, --max-model-len, --chat-template,
and one-line errors for every bad value. A real meshd on 127.0.0.1 with the tiny random-weight Llama."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.http_client import send
from tests.support.meshd import Daemon, free_port, run_meshd, run_meshd_in_process

KEY = "conventional-api-key-0123456789"
ORIGIN = "https://app.example"
# renders each message's text alone: far fewer prompt tokens than the model's own template (its system prompt)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
PROMPT = [{"role": "user", "content": "Tell me about owls."}]


AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def node(tiny_model, tmp_path_factory):
    files = tmp_path_factory.mktemp("conventions")
    (files / "api-key").write_text(KEY + "\n")
    (files / "chat.jinja").write_text(TEMPLATE)
    daemon = Daemon(tiny_model("llama"), "0-3", log_dir=files, extra=[
        "--api-key-file", str(files / "api-key"), "--allowed-origins", f"{ORIGIN},http://localhost:3000",
        "--max-model-len", "64", "--chat-template", str(files / "chat.jinja")]).wait_ready()
    yield daemon
    daemon.stop()


@pytest.mark.slow
def test_the_api_key_from_its_file_guards_every_endpoint_but_health(node):
    assert send("GET", node.url + "/health").status == 200
    assert send("GET", node.url + "/v1/status").status == 401
    assert send("GET", node.url + "/v1/status", headers={"Authorization": "Bearer not-the-key-at-all"}).status == 401
    assert send("GET", node.url + "/v1/status", headers=AUTH).status == 200


@pytest.mark.slow
def test_a_preflight_from_an_allowed_origin_passes_without_the_key(node):
    status, headers, _ = send("OPTIONS", node.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    allowed = {h.strip().lower() for h in headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os"} <= allowed  # an SDK's own headers pass too
    assert int(headers["Access-Control-Max-Age"]) > 0


@pytest.mark.slow
def test_answers_to_an_allowed_origin_carry_cors_headers_errors_and_streams_too(node):
    status, headers, _ = send("GET", node.url + "/v1/models", headers=AUTH | {"Origin": ORIGIN})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN and "Origin" in headers["Vary"]
    status, headers, _ = send("GET", node.url + "/v1/models", headers={"Origin": ORIGIN})  # no key
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ORIGIN  # the page can read why
    reply = send("POST", node.url + "/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2, "stream": True},
                 headers=AUTH | {"Origin": ORIGIN})
    assert reply.status == 200 and reply.headers.get("Access-Control-Allow-Origin") == ORIGIN


@pytest.mark.slow
def test_other_origins_get_no_cors_headers(node):
    status, headers, _ = send("OPTIONS", node.url + "/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 401 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = send("GET", node.url + "/v1/models", headers=AUTH | {"Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


@pytest.mark.slow
def test_max_model_len_bounds_prompt_and_answer_and_is_reported(node):
    assert send("GET", node.url + "/v1/status", headers=AUTH).data["context_length"] == 64
    assert send("GET", node.url + "/v1/models", headers=AUTH).data["data"][0]["max_model_len"] == 64
    status, _, data = send("POST", node.url + "/v1/chat/completions", headers=AUTH,
                           json={"messages": PROMPT, "max_tokens": 65})
    assert status == 400 and data["error"]["param"] == "max_tokens"
    status, _, data = send("POST", node.url + "/v1/chat/completions", headers=AUTH,
                           json={"messages": [{"role": "user", "content": " ".join(["owl"] * 80)}]})
    assert status == 400 and "this node's --max-model-len is 64" in data["error"]["message"], data
    status, _, data = send("POST", node.url + "/v1/chat/completions", headers=AUTH,
                           json={"messages": PROMPT, "max_tokens": 64, "ignore_eos": True, "temperature": 0})
    assert status == 200
    usage = data["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64, usage


@pytest.mark.slow
def test_the_chat_template_file_replaces_the_models(node, tiny_model):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model("llama") / "tokenizer.json"))
    expected = len(tokenizer.encode("Tell me about owls.\n", add_special_tokens=False).ids)
    status, _, data = send("POST", node.url + "/v1/chat/completions", headers=AUTH,
                           json={"messages": PROMPT, "max_tokens": 1})
    assert status == 200 and data["usage"]["prompt_tokens"] == expected


# ---- one line, never a traceback --------------------------------------------------------------


def meshd(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``meshd`` on a free port, in an environment of PATH, a home with no config, and ``env``."""
    return run_meshd("--port", str(free_port()), *args,
                     env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)} | (env or {}))


def meshd_here(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`meshd` run in this process (for a command that refuses to start): no Python start of its own."""
    return run_meshd_in_process("--port", str(free_port()), *args,
                                env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)} | (env or {}))


def one_line_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("meshd: error: ") and result.stderr.count("\n") == 1, result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    """A CA, a certificate for 127.0.0.1 and its key, and another certificate's key, as PEM files."""
    trustme = pytest.importorskip("trustme")
    folder = tmp_path_factory.mktemp("pem")
    ca = trustme.CA()
    cert, other = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    cert.private_key_pem.write_to_path(str(folder / "key.pem"))
    other.private_key_pem.write_to_path(str(folder / "other-key.pem"))
    (folder / "empty").write_text("")
    (folder / "not-pem").write_text("hello\n")
    return folder


@pytest.mark.parametrize("args, env, expected", [
    (["--api-key-file", "{d}/absent"], {}, ["--api-key-file", "cannot read"]),
    (["--api-key-file", "{d}/empty"], {}, ["--api-key-file", "empty"]),
    ([], {"MESHNET_API_KEY_FILE": "{d}"}, ["MESHNET_API_KEY_FILE", "cannot read"]),
    ([], {"MESHNET_API_KEY": "k" * 16, "MESHNET_TOKEN": "t" * 16}, ["MESHNET_API_KEY and MESHNET_TOKEN"]),
    (["--api-key", "short"], {}, ["--api-key must be"]),
    (["--allowed-origins", "https://a.example/path"], {}, ["--allowed-origins"]),
    ([], {"MESHNET_ALLOWED_ORIGINS": "ftp://a"}, ["MESHNET_ALLOWED_ORIGINS"]),
    ([], {"MESHNET_MAX_MODEL_LEN": "long"}, ["MESHNET_MAX_MODEL_LEN"]),
    (["--max-model-len", "1"], {}, ["--max-model-len"]),
    (["--chat-template", "{d}/absent.jinja"], {}, ["--chat-template", "cannot read"]),
    (["--chat-template", "{d}/empty"], {}, ["--chat-template", "empty"]),
    (["--ssl-certfile", "{d}/cert.pem"], {}, ["--ssl-keyfile"]),
    (["--ssl-certfile", "{d}/absent.pem", "--ssl-keyfile", "{d}/key.pem"], {}, ["--ssl-certfile", "cannot read"]),
    (["--ssl-certfile", "{d}/cert.pem", "--ssl-keyfile", "{d}/other-key.pem"], {}, ["is not the private key"]),
    (["--ssl-certfile", "{d}/not-pem", "--ssl-keyfile", "{d}/key.pem"], {}, ["--ssl-certfile", "PEM"]),
    (["--ssl-ca-file", "{d}/not-pem"], {}, ["--ssl-ca-file", "PEM"]),
    (["--ssl-certfile", "{d}/cert.pem", "--ssl-keyfile", "{d}/key.pem", "--public-url", "http://10.0.0.2:8476"], {},
     ["--public-url http://10.0.0.2:8476", "https://"]),
    ([], {"MESHNET_SSL_CA_FILE": "{d}/absent"}, ["--ssl-ca-file", "cannot read"]),
    ([], {"MESHNET_LOG_LEVEL": "verbose"}, ["MESHNET_LOG_LEVEL"]),
])
def test_a_bad_server_option_is_one_line(tmp_path, pem, args, env, expected):
    """Run in this process (the next test runs one as a command of its own)."""
    args = [a.format(d=pem) for a in args]
    env = {k: v.format(d=pem) for k, v in env.items()}
    one_line_error(meshd_here(tmp_path, *args, env=env), *expected)


def test_a_refusal_leaves_the_command_as_one_line_without_a_traceback(tmp_path, pem):
    result = meshd(tmp_path, "--ssl-certfile", str(pem / "cert.pem"), "--ssl-keyfile", str(pem / "other-key.pem"))
    one_line_error(result, "is not the private key")


@pytest.mark.slow
@pytest.mark.parametrize("args, expected", [
    (["--max-model-len", "2000"], ["--max-model-len 2000", "context (1024)"]),
    (["--chat-template", "{d}/broken.jinja"], ["--chat-template", "cannot render"]),
    (["--chat-template", "{d}/refusing.jinja"], ["--chat-template", "cannot render", "no system turns here"]),
])
def test_a_server_option_that_does_not_fit_the_model_is_one_line(tmp_path, tiny_model, args, expected):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    (tmp_path / "refusing.jinja").write_text("{{ raise_exception('no system turns here') }}")
    result = meshd_here(tmp_path, "--model", str(tiny_model("llama")), *[a.format(d=tmp_path) for a in args])
    one_line_error(result, *expected)


# ---- the console's side --------------------------------------------------------------------------


def test_the_console_takes_the_key_by_either_name():
    from meshtui.config import ConsoleConfig, ConsoleConfigError

    config = ConsoleConfig(token="from-the-config-file")
    assert config.mesh_token({"MESHNET_API_KEY": KEY}) == KEY
    assert config.mesh_token({"MESHNET_API_KEY": KEY, "MESHNET_TOKEN": KEY}) == KEY
    assert config.mesh_token({"MESHNET_API_KEY": ""}) == "from-the-config-file"
    with pytest.raises(ConsoleConfigError, match="different keys"):
        config.mesh_token({"MESHNET_API_KEY": KEY, "MESHNET_TOKEN": "another-key-0123456789"})
    with pytest.raises(ConsoleConfigError, match="MESHNET_API_KEY must be"):
        config.mesh_token({"MESHNET_API_KEY": "short"})


def test_the_console_refuses_an_unusable_ca_file_in_one_line(tmp_path):
    (tmp_path / "not-pem").write_text("hello\n")
    result = subprocess.run([sys.executable, "-m", "meshtui", "--config", str(tmp_path / "meshtui.toml"),
                             "--connect", "https://127.0.0.1:9", "--ssl-ca-file", str(tmp_path / "not-pem")],
                            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                                              "HOME": str(tmp_path)})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("meshtui: error: --ssl-ca-file") and result.stderr.count("\n") == 1
