"""The README's option tables name every option there is, with its environment variable."""

from __future__ import annotations

from pathlib import Path

from daemon.config import SETTINGS
from meshtui.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def section(heading: str) -> list[str]:
    """The table rows under ``heading`` (up to the next heading)."""
    lines = README.read_text().splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
    return [line for line in lines[start:end] if line.startswith("|")]


def test_the_options_table_has_every_meshd_setting_with_its_variable():
    rows = section("### Options")
    missing = []
    for s in SETTINGS:
        wanted = [f"`{s.env_var}`"] + ([f"`{s.flag}"] if s.flag else [])
        if not any(all(w in row for w in wanted) for row in rows):
            missing.append(" and ".join(wanted))
    assert not missing, f"rows missing from the README's options table: {missing}"


def test_the_console_options_table_has_every_meshtui_flag():
    rows = section("### Console options")
    flags = [o for action in build_parser()._actions for o in action.option_strings if o.startswith("--")]
    missing = [f for f in flags if f not in ("--help", "--version") and not any(f"`{f}" in row for row in rows)]
    assert not missing, f"meshtui flags missing from the README's console options table: {missing}"
