"""The help screen: every key binding as it is bound now, with the id to remap it by."""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


@dataclass(frozen=True)
class BindingHelp:
    where: str
    keys: str
    description: str
    binding_id: str


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,question_mark,q", "dismiss(None)", "Close", id="help.close")]

    def __init__(self, bindings: list[BindingHelp], config_path: str | None) -> None:
        super().__init__()
        self.bindings = bindings
        self.config_path = config_path

    def compose(self) -> ComposeResult:
        table = Table(box=None, padding=(0, 2, 0, 0), expand=True, header_style="bold")
        table.add_column("where", style="dim", no_wrap=True)
        table.add_column("key", style="bold", no_wrap=True)
        table.add_column("action")
        table.add_column(Text("id, for [keys]"), style="dim", no_wrap=True)
        for row in self.bindings:
            table.add_row(row.where, row.keys, row.description, row.binding_id)
        notes = Text()
        notes.append("*", style="bold")
        notes.append(" only where no text field has the focus: in the chat's prompt it is typed.\n")
        notes.append("^p", style="bold")
        notes.append(" opens the command palette: every action above, plus themes. ")
        notes.append("^c", style="bold")
        notes.append(" copies text selected with the mouse.\n")
        notes.append("Remap a key under ")
        notes.append("[keys]", style="bold")
        notes.append(f" in {self.config_path or 'meshtui.toml'}, e.g. ")
        notes.append('"chat.export" = "f9"', style="italic")
        notes.append(". The mouse works everywhere: tabs, rows, buttons.")
        with Vertical(classes="dialog", id="help") as dialog:
            dialog.border_title = "meshtui · keys"
            dialog.border_subtitle = "Esc closes"
            with VerticalScroll():
                yield Static(table)
            yield Static(notes, id="help-notes")
