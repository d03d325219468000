"""One streamed answer in the Chat view: Markdown fed through a stream, then a line of what it cost.

A module of its own so that Markdown (markdown_it, pygments) loads with the first answer, not at start.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from meshtui.screens.throughput import generation_stats
from meshtui.state import GenerationRecord
from meshtui.widgets.formatting import plural


class Answer(Vertical):
    """One streamed answer: a Markdown body fed through a stream, and a line of what it cost."""

    def __init__(self) -> None:
        super().__init__(classes="answer")
        self.body = Markdown()
        self.stats = Static(Text("streaming…", style="dim"), classes="answer-stats")
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield self.body
        yield self.stats

    def start(self) -> None:
        self._stream = Markdown.get_stream(self.body)

    async def write(self, text: str) -> None:
        if self._stream is not None:
            await self._stream.write(text)

    async def finish(self, record: GenerationRecord) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        # render the whole text once more: fragments can leave a code fence or a list half-parsed
        await self.body.update(record.text)
        if record.outcome == "done":
            self.stats.update(generation_stats(record))
        elif record.outcome == "cancelled":
            self.stats.update(Text(f"cancelled after {plural(record.tokens, 'token')}", style="yellow"))
        else:
            self.stats.update(Text(f"failed: {record.error}", style="bold red"))
