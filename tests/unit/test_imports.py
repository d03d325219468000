"""The import graph, read from the source: no circles, nothing imports up a layer, and the console
knows the daemon only through ``daemon.api``.

Every import counts, at the top of a module or inside a function (a lazy import still ties two
modules together). Layers of the daemon, lowest first (``docs/architecture.md``: ``server -> mesh -> model``):

    daemon.api, errors, logs    shapes and vocabulary, used everywhere; with them,
      host, settings            this machine's cores and CPU name, and the engine config.py's settings run on
    wire, channel, kvstore,     the protocol (a step and its frames), session caches, metrics, settings
      metrics, config
    model                       torch: the shard, the /forward step
    mesh                        the head: routes, the generation loop
    server                      aiohttp handlers
    node, handover              the wiring, and a draining node's sessions handed to its peers
    bench, plan                 meshd bench, meshd plan: their own trees, which never import the command line
    cli                         meshd's command line (``meshd bench`` imports the bench lazily)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("daemon", "meshtui")

LAYERS = [
    ("daemon", "daemon.api", "daemon.errors", "daemon.logs", "daemon.host", "daemon.settings"),
    ("daemon.wire", "daemon.channel", "daemon.kvstore", "daemon.metrics", "daemon.config"),
    ("daemon.model",),
    ("daemon.mesh",),
    ("daemon.server",),
    ("daemon.node", "daemon.handover"),
    ("daemon.bench", "daemon.plan"),
    ("daemon.cli",),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (``from a import b`` counts ``a.b`` when that is a module)."""
    return {m for m in all_imports(name, path) if m in known and m != name}


def all_imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports, relative imports resolved; ``from a import b`` also names ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def layer_of(module: str) -> int:
    """The layer of a daemon module: its longest listed prefix decides (``daemon.api.launch`` is ``daemon.api``)."""
    best, rank = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def test_the_graph_is_read_from_the_source(graph):
    # the reader itself: known edges are found, lazy ones included
    assert "daemon.api" in graph["meshtui.client"]
    assert "daemon.bench" in graph["daemon.cli"]  # imported inside main()
    assert "daemon.model.service" in graph["daemon.node"]


def test_no_module_imports_itself_back_through_others(graph):
    """No circles: Tarjan's strongly connected components are all single modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert circles == []


def test_nothing_in_the_daemon_imports_up_a_layer(graph):
    upward = [(module, other) for module, others in graph.items() if module.startswith("daemon")
              for other in others if other.startswith("daemon") and layer_of(other) > layer_of(module)]
    assert upward == []


def test_the_console_imports_only_daemon_api(graph):
    allowed = lambda m: m == "daemon" or m == "daemon.api" or m.startswith("daemon.api.")  # noqa: E731
    reaching = [(module, other) for module, others in graph.items() if module.startswith("meshtui")
                for other in others if other.startswith("daemon") and not allowed(other)]
    assert reaching == []


def test_daemon_api_stands_alone(graph):
    """What the console imports pulls in nothing else of the daemon (and so no torch, no aiohttp)."""
    api = [m for m in graph if m == "daemon.api" or m.startswith("daemon.api.")]
    assert api and all(other == "daemon" or other.startswith("daemon.api") for m in api for other in graph[m])
