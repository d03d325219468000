"""The Chat view: a prompt, and answers streamed from the head token by token, under the system prompt if set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Input, Static

from meshtui.config import ChatSettings
from meshtui.messages import (
    CancelRequested,
    ChatSettingsChanged,
    ExportRequested,
    NewConversationRequested,
    PromptSubmitted,
    SystemPromptChanged,
)
from meshtui.screens.modals import SystemPromptScreen
from meshtui.screens.settings import ChatSettingsScreen
from meshtui.state import GenerationRecord, MeshState
from meshtui.widgets.formatting import format_rate, plural

if TYPE_CHECKING:
    from meshtui.screens.answer import Answer


class ChatView(Vertical):
    """The conversation follows new text only while the operator is at its bottom (an anchored scroll)."""

    # Ctrl keys, not letters: they work while the prompt has the focus (Input keeps ctrl+a/e/d/k/u/w/x/c/v)
    BINDINGS = [
        # Escape cancels while an answer streams (the footer shows it only then), else leaves the prompt
        Binding("escape", "cancel", "Cancel", id="chat.cancel", tooltip="Cancel the answer being streamed"),
        Binding("escape", "leave_prompt", "Leave prompt", id="chat.leave", show=False,
                tooltip="Leave the prompt, so the single-letter keys work"),
        Binding("ctrl+n", "new_conversation", "New chat", id="chat.new"),
        Binding("ctrl+t", "system_prompt", "System", id="chat.system", tooltip="System prompt"),
        Binding("ctrl+s", "settings", "Sampling", id="chat.settings"),
        Binding("ctrl+o", "export", "Export", id="chat.export"),
    ]

    def __init__(self, settings: ChatSettings, state: MeshState, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.settings = settings
        self.state = state
        self.system = Static(id="chat-system")
        self.conversation = VerticalScroll(id="conversation")
        self.status = Static(id="chat-status")
        self.prompt = Input(placeholder="Ask the mesh…  (Enter sends)", id="prompt")
        self._answers: dict[int, Answer] = {}
        self._streaming: GenerationRecord | None = None
        self._last: GenerationRecord | None = None  # the latest answer that ended, however it ended

    def compose(self) -> ComposeResult:
        yield self.system
        with self.conversation:
            yield Static(Text("Ask the mesh anything: the head plans a route and streams the answer here. "
                              "Every turn is sent again, so the model sees the whole conversation.",
                              style="dim"), id="chat-hint")
        yield self.status
        yield self.prompt

    def on_mount(self) -> None:
        self.conversation.anchor()
        self.show_settings(self.settings)
        self.show_system_prompt()

    @property
    def streaming(self) -> bool:
        return self._streaming is not None

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        text = event.value.strip()
        if not text:
            return
        if self.streaming:
            self.notify("An answer is still streaming: cancel it first.", severity="warning")
            return
        event.input.clear()
        self.post_message(PromptSubmitted(text))

    async def begin(self, record: GenerationRecord) -> None:
        """Show the prompt and an empty answer that chunks will stream into."""
        from meshtui.screens.answer import Answer  # Markdown and its parser load with the first answer

        self._streaming = record
        self.refresh_bindings()  # Escape cancels now
        answer = self._answers[record.number] = Answer()
        await self.conversation.mount_all([Static(Text(record.prompt), classes="prompt"), answer])
        answer.start()
        self._show_status()

    async def append(self, record: GenerationRecord, text: str) -> None:
        answer = self._answers.get(record.number)
        if answer is not None and text:
            await answer.write(text)
        self._show_status()

    async def finish(self, record: GenerationRecord) -> None:
        answer = self._answers.get(record.number)
        if answer is not None:
            await answer.finish(record)
        if self._streaming is record:
            self._streaming = None
            self.refresh_bindings()
        if answer is not None:  # else an answer of a conversation cleared since: nothing of it is shown
            self._last = record
        self._show_status()

    async def clear(self) -> None:
        """A new conversation: every turn off the pane, the hint back."""
        self._answers = {}
        self._streaming = self._last = None
        self.refresh_bindings()
        await self.conversation.query_children().exclude("#chat-hint").remove()
        self._show_status()

    def show_system_prompt(self) -> None:
        """The system prompt above the conversation, while there is one."""
        text = self.state.system_prompt
        self.system.display = bool(text)
        line = Text("system  ", style="bold")
        line.append(text.replace("\n", " ⏎ "))
        self.system.update(line)

    def show_settings(self, settings: ChatSettings) -> None:
        self.settings = settings
        self._show_status()

    def _show_status(self) -> None:
        status = Text()
        record = self._streaming
        if record is not None:
            status.append(f"answering #{record.number}", style="bold cyan")
            status.append(f" · {plural(len(record.chunk_times), 'token')} · {format_rate(record.tokens_per_second)}")
        else:
            self._show_reuse(status)
            s = self.settings
            seed = "random" if s.seed is None else str(s.seed)
            status.append(f"temperature {s.temperature:g} · top_p {s.top_p:g} · top_k {s.top_k} · "
                          f"max {s.max_tokens} tokens · seed {seed}", style="dim")
        self.status.update(status)

    def _show_reuse(self, status: Text) -> None:
        """How much of the last answer's prompt the nodes still held from the turns before (their KV, reused)."""
        last = self._last
        reuse = last.prompt_reuse if last is not None and last.outcome == "done" else None
        if reuse is None:
            return
        cached, prompt = reuse
        status.append(f"reused {cached} of {plural(prompt, 'prompt token')}", style="green" if cached else "")
        status.append(" · ", style="dim")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel":
            return self.streaming
        if action == "leave_prompt":
            return not self.streaming
        return True

    def action_cancel(self) -> None:
        self.post_message(CancelRequested())

    def action_leave_prompt(self) -> None:
        # nothing to cancel: leave the prompt so the single-letter shortcuts (1-4, a, r, ?) work again
        self.conversation.focus()

    def action_settings(self) -> None:
        def save(settings: ChatSettings | None) -> None:
            if settings is not None:
                self.post_message(ChatSettingsChanged(settings))

        self.app.push_screen(ChatSettingsScreen(self.settings, self.state.chat_limits), save)

    def action_new_conversation(self) -> None:
        self.post_message(NewConversationRequested())

    def action_system_prompt(self) -> None:
        def save(text: str | None) -> None:
            if text is not None:
                self.post_message(SystemPromptChanged(text))

        self.app.push_screen(SystemPromptScreen(self.state.system_prompt), save)

    def action_export(self) -> None:
        self.post_message(ExportRequested())

    def focus_prompt(self) -> None:
        self.prompt.focus()
