"""The docs stay true: the option tables name every option there is, the architecture tree names every
module there is (and no other), every relative link leads to a file, and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

from daemon.config import SETTINGS
from meshtui.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
OPERATING = ROOT / "docs" / "operating.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("daemon", "meshtui")


def section(heading: str, page: Path = OPERATING) -> list[str]:
    """The table rows under ``heading`` (up to the next heading)."""
    lines = page.read_text().splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
    return [line for line in lines[start:end] if line.startswith("|")]


def test_the_options_table_has_every_meshd_setting_with_its_variable():
    rows = section("## Options")
    missing = []
    for s in SETTINGS:
        wanted = [f"`{s.env_var}`"] + ([f"`{s.flag}"] if s.flag else [])
        if not any(all(w in row for w in wanted) for row in rows):
            missing.append(" and ".join(wanted))
    assert not missing, f"rows missing from docs/operating.md's options table: {missing}"


def test_the_console_options_table_has_every_meshtui_flag():
    rows = section("## Console options")
    flags = [o for action in build_parser()._actions for o in action.option_strings if o.startswith("--")]
    missing = [f for f in flags if f not in ("--help", "--version") and not any(f"`{f}" in row for row in rows)]
    assert not missing, f"meshtui flags missing from docs/operating.md's console options table: {missing}"


def tree_modules() -> set[str]:
    """The module paths the tree in docs/architecture.md names.

    The tree is the first fenced block after "## The tree": one entry a line, indented two spaces a
    level, a folder ending in ``/`` and a module ending in ``.py``, then a note on its job.
    """
    lines = ARCHITECTURE.read_text().splitlines()
    start = lines.index("## The tree")
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    folders: list[str] = []
    named = set()
    for line in lines[fence + 1 : end]:
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        entry = line.split()[0]
        del folders[depth:]
        if entry.endswith("/"):
            folders.append(entry.rstrip("/"))
        elif entry.endswith(".py"):
            named.add("/".join([*folders, entry]))
    return named


def test_the_architecture_tree_names_every_module_and_only_those():
    on_disk = {
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    named = tree_modules()
    missing, extra = sorted(on_disk - named), sorted(named - on_disk)
    assert not missing and not extra, (
        "docs/architecture.md's tree is out of date:\n"
        f"  modules on disk the tree does not name: {missing}\n"
        f"  modules the tree names that do not exist: {extra}"
    )


def markdown_pages() -> list[Path]:
    return [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = [line.lstrip("#").strip() for line in page.read_text().splitlines() if re.match(r"#+ ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_leads_to_a_file():
    broken = []
    for page in markdown_pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"relative links that lead nowhere: {broken}"


def test_the_readme_is_read_in_ten_minutes():
    assert len(README.read_text().splitlines()) <= 400
