"""Small dialogs: a yes/no confirmation, a peer address prompt and the chat's system prompt."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, TextArea

from meshtui.config import normalize_url


class ConfirmScreen(ModalScreen[bool]):
    """Ask a yes/no question; dismisses with True only on an explicit yes."""

    BINDINGS = [
        Binding("y", "dismiss(True)", "Yes", id="confirm.yes"),
        Binding("n,escape", "dismiss(False)", "No", id="confirm.no"),
    ]

    def __init__(self, question: str, detail: str = "", yes_label: str = "Yes") -> None:
        super().__init__()
        self.question = question
        self.detail = detail
        self.yes_label = yes_label

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog") as dialog:
            dialog.border_title = "confirm"
            yield Label(self.question, classes="question", markup=False)
            if self.detail:
                yield Label(self.detail, classes="detail", markup=False)
            with Horizontal(classes="buttons"):
                yield Button(f"{self.yes_label} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # a stray Enter must not destroy anything

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class PeerScreen(ModalScreen[str | None]):
    """Ask for a daemon address (``host:port`` or a URL); dismisses with the normalised URL or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="peer.cancel")]

    def __init__(self, title: str, action_label: str, value: str = "") -> None:
        super().__init__()
        self.title_text = title
        self.action_label = action_label
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog") as dialog:
            dialog.border_title = self.title_text
            yield Label("Address of the meshd daemon, e.g. 10.0.0.2:7071", classes="detail")
            yield Input(self.value, placeholder="http://host:port", id="url")
            yield Label("", classes="problem", id="problem", markup=False)
            with Horizontal(classes="buttons"):
                yield Button(self.action_label, variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ok":
            self._submit()
        else:
            self.dismiss(None)

    def _submit(self) -> None:
        try:
            url = normalize_url(self.query_one("#url", Input).value)
        except ValueError as exc:
            self.query_one("#problem", Label).update(f"Not an address: {exc}")
            return
        self.dismiss(url)


class SystemPromptScreen(ModalScreen[str | None]):
    """Edit the conversation's system prompt; dismisses with the new text ("" to have none) or None when cancelled."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Cancel", id="system.cancel"),
        Binding("ctrl+s", "save", "Save", id="system.save"),
    ]

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="system-dialog") as dialog:
            dialog.border_title = "system prompt"
            dialog.border_subtitle = "ctrl+s saves · esc cancels"
            yield Label("Sent first in every request of this conversation, as the system message. "
                        "Empty: none.", classes="detail")
            yield TextArea(self.text, id="system-text", soft_wrap=True, show_line_numbers=False)
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Clear", id="clear")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        elif event.button.id == "clear":
            self.query_one("#system-text", TextArea).clear()
        else:
            self.dismiss(None)

    def action_save(self) -> None:
        self.dismiss(self.query_one("#system-text", TextArea).text.strip())
