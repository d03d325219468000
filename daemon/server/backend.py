"""What the HTTP handlers need from a node, as small protocols.

``daemon.node.Node`` is the real one; anything with these attributes can stand behind
:func:`daemon.server.app.create_app` (the console's tests run the real app over a fake).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol

from daemon import wire
from daemon.api import NodeStatus, PeerSummary, RouteInfo, SessionList
from daemon.mesh.head import ChatRequest, Generation
from daemon.metrics import Metrics


class ForwardService(Protocol):
    """``POST /forward``: one step over this node's layers (``daemon.model.service.ShardService``)."""

    hidden_size: int
    start: int
    end: int

    async def forward(self, request: wire.ForwardRequest) -> wire.ForwardReply: ...

    def serve_now(self, request: wire.ForwardRequest) -> wire.ForwardReply:
        """One step on the torch thread itself: a step channel's (``daemon.server.channel``)."""

    def serve_channel(self, sock, handler) -> bool:
        """Hand a step channel's socket to the torch thread, which calls ``handler(sock)`` as its steps arrive."""


class ChatHead(Protocol):
    """The OpenAI endpoints: generations this node heads (``daemon.mesh.head.Head``)."""

    model_name: str
    model_names: list[str]  # the first is model_name; the others, aliases requests may name

    @property
    def max_tokens_cap(self) -> int: ...

    def generate(self, request: ChatRequest) -> AbstractAsyncContextManager[Generation]: ...


class NodeBackend(Protocol):
    """Everything a node's endpoints read or change, and the work it does while it serves."""

    service: ForwardService
    head: ChatHead
    metrics: Metrics
    draining: bool  # shutting down: finish what runs, take nothing new
    forwards_in_flight: int  # /forward requests past the drain check and not yet answered

    def status(self) -> NodeStatus: ...

    def sessions(self) -> SessionList: ...

    def drop_session(self, session_id: str) -> bool: ...

    def retain_session(self, session_id: str, past_len: int | None = None) -> bool: ...

    def route(self, *, refresh: bool) -> RouteInfo:
        """The head's route, planned afresh when ``refresh`` or when there is none yet."""

    async def add_peer(self, url: str) -> list[PeerSummary]:
        """Add a peer and ask it for its status at once; the peers as they stand then."""

    def remove_peer(self, url: str) -> bool: ...

    def peer_left(self, url: str, moved: dict[str, str] | None = None) -> bool: ...

    async def session_moved_to(self, session_id: str | None) -> str | None:
        """Draining: the node a session's steps go to now that this one handed it on (waiting for a transfer
        under way); None where it stays."""

    def serving(self) -> AbstractAsyncContextManager[None]:
        """Background work while the app serves (peer polls, the hop client), stopped when it ends."""
