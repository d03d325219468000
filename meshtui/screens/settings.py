"""The chat's sampling settings, edited in a small dialog bounded by what the head accepts."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from meshtui.config import ChatSettings
from meshtui.state import ChatLimits

# field -> (label, input type, lowest, highest); the daemon enforces the same bounds with a 400, and
# max_tokens also to the head's cap (which it reports in /v1/status)
FIELDS = {
    "temperature": ("temperature", "number", 0.0, 2.0),
    "top_p": ("top_p", "number", 0.0, 1.0),
    "top_k": ("top_k (0 = off)", "integer", 0, 1_000_000),
    "max_tokens": ("max tokens", "integer", 1, 1_000_000),
    "seed": ("seed (empty = random)", "integer", -(2**63), 2**63 - 1),
}


class ChatSettingsScreen(ModalScreen[ChatSettings | None]):
    """Dismisses with new :class:`ChatSettings`, or None when cancelled."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="settings.cancel")]

    def __init__(self, settings: ChatSettings, limits: ChatLimits | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.limits = limits or ChatLimits()

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog") as dialog:
            dialog.border_title = "sampling"
            with Grid(id="settings-grid"):
                for name, (label, kind, _, _) in FIELDS.items():
                    value = getattr(self.settings, name)
                    yield Label(label)
                    yield Input("" if value is None else str(value), type=kind, compact=True, id=name)
            yield Label(self._limits_text(), classes="detail", id="limits", markup=False)
            yield Label("", classes="problem", id="problem", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self._save()
        else:
            self.dismiss(None)

    def _limits_text(self) -> str:
        cap, context = self.limits.max_tokens, self.limits.context_length
        if cap is None:
            return "The head has not said how many tokens it allows (an older meshd): it refuses too many itself."
        text = f"The head allows up to {cap} new tokens per answer"
        return text + (f", prompt and answer within {context} tokens." if context else ".")

    def _save(self) -> None:
        values = {}
        for name, (label, kind, lowest, highest) in FIELDS.items():
            if name == "max_tokens" and self.limits.max_tokens is not None:
                highest = self.limits.max_tokens
            text = self.query_one(f"#{name}", Input).value.strip()
            if not text and name == "seed":
                values[name] = None
                continue
            try:
                value = float(text) if kind == "number" else int(text)
            except ValueError:
                return self._complain(f"{label} must be a{'n integer' if kind == 'integer' else ' number'}")
            if name == "max_tokens" and value > highest and self.limits.max_tokens is not None:
                return self._complain(f"{label} must be between {lowest} and {highest}: the head's cap")
            if not lowest <= value <= highest or (name == "top_p" and value == 0):
                return self._complain(f"{label} must be between {lowest} and {highest}")
            values[name] = value
        self.dismiss(ChatSettings(**values))

    def _complain(self, message: str) -> None:
        self.query_one("#problem", Label).update(message)
