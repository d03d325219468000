"""A console whose chat answers are posted to it as messages, for snapshots whose point is the picture.

:class:`AnsweringConsole` is the real :class:`meshtui.app.MeshApp` with one worker replaced: instead of
streaming ``/v1/chat/completions`` over HTTP, it asks a :class:`tests.support.tui_data.ScriptedHead` in its own
event loop. Each chunk still goes through meshd's own chunk writer and JSON and the console client's own
parser, then is posted as the :class:`GenerationChunk` and :class:`GenerationEnded` messages the real worker
posts, so every handler that draws the chat runs as it does against a daemon; only the socket and the thread
are gone (the HTTP path has its own tests in ``tests/console/test_tui_pilot.py``).

The head moves the frozen clock before each chunk, and a chunk is stamped when it is posted, so the
timings on screen do not depend on how fast the machine runs the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from pathlib import Path

from textual import work

from daemon.server.openai import _chat_chunks, parse_chat_request
from meshtui.app import MeshApp
from meshtui.client import _chunk
from meshtui.messages import GenerationChunk, GenerationEnded
from tests.support.tui_data import ScriptedHead


class AnsweringConsole(MeshApp):
    """A console answered by ``head`` (its :attr:`head`, which a test may re-script between turns)."""

    CSS_PATH = Path(inspect.getfile(MeshApp)).with_name(MeshApp.CSS_PATH)  # Textual reads it beside the subclass
    # a notification must outlive a slow machine's way to the snapshot: its timer runs on the real clock
    NOTIFICATION_TIMEOUT = 3600

    def __init__(self, *args, head: ScriptedHead, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head = head

    @work(exclusive=True, group="chat")
    async def _stream_answer(self, number: int, head_url: str, messages: list[dict], params: dict) -> None:
        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}} | params
        chat, options = parse_chat_request(body, max_tokens_cap=self.head.max_tokens_cap)
        try:
            async with self.head.generate(chat) as generation:
                chunks = _chat_chunks(generation, chat, options)
                async with contextlib.aclosing(chunks):
                    async for event in chunks:
                        chunk = _chunk(json.loads(json.dumps(event)))  # what the wire would have carried
                        self.post_message(GenerationChunk(number, chunk, self.clock()))
        except asyncio.CancelledError:
            self.post_message(GenerationEnded(number, "cancelled"))
            raise
        self.post_message(GenerationEnded(number, "done"))

