"""A console-only install: ``pip install meshnet`` gives an operator's laptop ``meshtui --connect``
without torch or transformers; a node needs ``meshnet[node]``.

The import graph is read from the source, a process with the node's packages blocked attaches the
console to a real node, and (slow) a fresh virtual environment installs the project from PyPI's
index and is checked for what it holds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from daemon.api.launch import NODE_PACKAGES
from tests.support.meshd import Daemon
from tests.unit.test_imports import all_imports, project_modules

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("daemon", "meshtui")
# the import names of the console's own dependencies (pyproject's base list)
CONSOLE_IMPORTS = {"aiohttp": "aiohttp", "platformdirs": "platformdirs", "rich": "rich", "tomli_w": "tomli-w",
                   "textual": "textual"}
NODE_DISTRIBUTIONS = {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors",
                      "gguf": "gguf", "prometheus_client": "prometheus-client",
                      "pythonjsonlogger": "python-json-logger", "httptools": "httptools"}

# run first in a child: every import of a node package fails, as on a laptop that never installed them
BLOCK_NODE_PACKAGES = f"""
import sys
BLOCKED = {set(NODE_PACKAGES)!r}
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
import importlib.util
importlib.util.find_spec = (lambda find: lambda name, package=None:
    None if name.partition(".")[0] in BLOCKED else find(name, package))(importlib.util.find_spec)
"""


def console_imports() -> tuple[set[str], set[str]]:
    """The project modules the console reaches from its own package, and the outside packages they import."""
    modules = project_modules()
    todo = [name for name in modules if name.partition(".")[0] == "meshtui"]
    reached: set[str] = set()
    outside: set[str] = set()
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        for imported in all_imports(name, modules[name]):
            top = imported.partition(".")[0]
            if top in PROJECT:  # the module, and each package's __init__ on the way to it (it runs first)
                parts = imported.split(".")
                todo += [m for m in (".".join(parts[:depth]) for depth in range(1, len(parts) + 1)) if m in modules]
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                outside.add(top)
    return reached, outside


def test_the_console_imports_only_the_packages_a_console_only_install_has():
    modules, outside = console_imports()
    assert "daemon.api" in modules and "meshtui.app" in modules  # the walk follows imports at all
    assert not any(m.startswith(("daemon.model", "daemon.mesh", "daemon.server")) for m in modules), modules
    assert outside <= set(CONSOLE_IMPORTS), f"the console imports {sorted(outside - set(CONSOLE_IMPORTS))}, " \
                                            "which `pip install meshnet` does not install"


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_base_install_is_the_console_and_the_node_extra_adds_the_rest():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base, node = _names(project["dependencies"]), _names(project["optional-dependencies"]["node"])
    assert base == set(CONSOLE_IMPORTS.values())
    assert set(NODE_DISTRIBUTIONS.values()) <= node and "torch" not in base
    assert set(NODE_DISTRIBUTIONS) == set(NODE_PACKAGES)  # meshd's check names what the extra installs


def run_console_only(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_NODE_PACKAGES + code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=os.environ | {"MESHTUI_CONFIG": "/nonexistent.toml"})


def test_meshd_and_a_local_console_say_what_a_console_only_install_lacks():
    done = run_console_only("""
import contextlib, io
from daemon.cli import main as meshd
from meshtui.cli import main as meshtui
for name, main, argv in (("meshd", meshd, ["--layers", "0-14"]), ("meshtui", meshtui, [])):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        print(name, main(argv), repr(err.getvalue()))
""")
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for name in ("meshd", "meshtui"):
        code, message = lines[name].split(" ", 1)
        message = eval(message)  # the repr printed above
        assert code == "2" and message.count("\n") == 1, message  # one line, no traceback
        assert "console-only install (no torch" in message and 'pip install "meshnet[node]"' in message
    assert "--connect URL" in eval(lines["meshtui"].split(" ", 1)[1])


@pytest.mark.slow
def test_a_console_only_process_attaches_to_a_real_node_and_chats(default_model, tmp_path):
    node = Daemon(default_model, "0-29", log_dir=tmp_path).wait_ready()
    try:
        done = run_console_only(f"""
import asyncio, sys
from meshtui.app import MeshApp
from meshtui.config import ConsoleConfig

async def main():
    config = ConsoleConfig(poll_seconds=0.3)
    config.chat.max_tokens = 4
    app = MeshApp(config, head_url={node.url!r})
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(300):
            if app.state.route and any(n.up for n in app.state.nodes.values()):
                break
            await pilot.pause(0.1)
        print("up", sum(n.up for n in app.state.nodes.values()), "layers", len(app.state.coverage()))
    print("node packages loaded", sorted({{m.partition(".")[0] for m in sys.modules}} & BLOCKED))

asyncio.run(main())
""", timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "up 1 layers 30" in done.stdout, done.stdout
        assert "node packages loaded []" in done.stdout
    finally:
        node.stop()


@pytest.mark.slow
def test_pip_installs_the_console_without_the_node(tmp_path):
    """A fresh environment, ``pip install`` of this checkout: the console works, torch is not there, and
    meshd says what to install."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(ROOT)], capture_output=True,
                             text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout.lower()
    assert "textual==8.2.8" in listed and "meshnet==" in listed
    assert not {d for d in NODE_DISTRIBUTIONS.values() if f"\n{d}==" in f"\n{listed}"}, listed
    version = subprocess.run([str(bin_dir / "meshtui"), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("meshtui "), version
    meshd = subprocess.run([str(bin_dir / "meshd"), "--layers", "0-14"], capture_output=True, text=True, timeout=60)
    assert meshd.returncode == 2 and 'pip install "meshnet[node]"' in meshd.stderr and "Traceback" not in meshd.stderr
