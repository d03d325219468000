"""Messages between the console's I/O workers and its views.

The workers post what they learned (polls, chat chunks, start-up lines); views post what the
operator asked for (a prompt, an eviction). Tests post the same messages to drive the real handlers.
"""

from __future__ import annotations

from textual.message import Message

from daemon.api import NodeStatus, RouteInfo, SessionList
from meshtui.client import ChatChunk
from meshtui.config import ChatSettings


class NodePolled(Message):
    """One node answered a poll (``status`` and ``sessions``), or did not (``error``, with the HTTP
    status if it answered one: 401 is a refused mesh token)."""

    def __init__(self, url: str, status: NodeStatus | None, sessions: SessionList | None,
                 error: str | None = None, http_status: int | None = None) -> None:
        super().__init__()
        self.url = url
        self.status = status
        self.sessions = sessions
        self.error = error
        self.http_status = http_status


class RoutePolled(Message):
    """The head's current route, or why it could not be had."""

    def __init__(self, route: RouteInfo | None, error: str | None = None) -> None:
        super().__init__()
        self.route = route
        self.error = error


class LocalProgress(Message):
    """A line of a local node's start-up output (loading the model, listening...)."""

    def __init__(self, node: str, line: str) -> None:
        super().__init__()
        self.node = node
        self.line = line


class LocalMeshReady(Message):
    def __init__(self, head_url: str, urls: list[str]) -> None:
        super().__init__()
        self.head_url = head_url
        self.urls = urls


class LocalMeshFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class GenerationChunk(Message):
    """One streamed chunk of answer ``number``, with its local arrival time."""

    def __init__(self, number: int, chunk: ChatChunk, arrived_at: float) -> None:
        super().__init__()
        self.number = number
        self.chunk = chunk
        self.arrived_at = arrived_at


class GenerationEnded(Message):
    """Answer ``number`` finished: ``outcome`` is done, cancelled or failed."""

    def __init__(self, number: int, outcome: str, error: str | None = None) -> None:
        super().__init__()
        self.number = number
        self.outcome = outcome
        self.error = error


class PromptSubmitted(Message):
    """The operator sent a prompt from the chat view."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class EvictConfirmed(Message):
    """The operator confirmed evicting a session from a node."""

    def __init__(self, url: str, session_id: str) -> None:
        super().__init__()
        self.url = url
        self.session_id = session_id


class CancelRequested(Message):
    """The operator asked to stop the answer being streamed."""


class ChatSettingsChanged(Message):
    """The operator saved new sampling settings for the chat."""

    def __init__(self, settings: ChatSettings) -> None:
        super().__init__()
        self.settings = settings


class PeerChangeRequested(Message):
    """The operator asked to add (or remove) a peer daemon."""

    def __init__(self, url: str, *, add: bool) -> None:
        super().__init__()
        self.url = url
        self.add = add


class NewConversationRequested(Message):
    """The operator asked for a new conversation: the answer in flight is cancelled, the turns forgotten."""


class SystemPromptChanged(Message):
    """The operator saved the conversation's system prompt (empty: none)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class ExportRequested(Message):
    """The operator asked to write the conversation out as Markdown and JSON."""
