"""The Sessions view: every node's KV sessions (live, or kept as a prefix) with TTL countdowns, and its store totals."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Static

from daemon.api import SessionInfo
from meshtui.messages import EvictConfirmed
from meshtui.screens.modals import ConfirmScreen
from meshtui.state import MeshState, NodeState
from meshtui.widgets.formatting import format_bytes, format_duration, plural, short_url
from meshtui.widgets.keyed_table import KeyedTable
from meshtui.widgets.section import Section

STORE_COLUMNS = [("node", "node"), ("sessions", "sessions"), ("bytes", "bytes"), ("ttl", "ttl"),
                 ("hits", "hits"), ("misses", "misses"), ("evictions", "evictions")]
SESSION_COLUMNS = [("node", "node"), ("session", "session"), ("kind", "kind"), ("past", "tokens"),
                   ("start", "from layer"), ("bytes", "bytes"), ("used", "last use"), ("ttl", "expires in")]
SHOWN_ID = 14  # session ids are 24 hex digits; the first 14 tell them apart on screen
SOON = 60.0  # seconds: a countdown below this turns yellow


class SessionsView(Vertical):
    """TTL countdowns are recomputed by :meth:`show_sessions` from the node's reported expiry and clock offset."""

    BINDINGS = [Binding("e", "evict", "Evict session", id="session.evict")]

    def __init__(self, state: MeshState, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.state = state
        self.stores = KeyedTable(STORE_COLUMNS, id="stores")
        self.live = Section("KV sessions", id="sessions-box")
        self.sessions = KeyedTable(SESSION_COLUMNS, id="sessions")
        self.no_sessions = Static("no sessions", id="no-sessions")

    def compose(self) -> ComposeResult:
        with Section("session stores", id="stores-box"):
            yield self.stores
        with self.live:
            yield self.sessions
            yield self.no_sessions

    def show_sessions(self, now: float) -> None:
        rows = {}
        prefixes = 0
        for node in self.state.nodes.values():
            for session in node.live_sessions:
                rows[f"{node.url} {session.session_id}"] = self._session_row(node, session, now)
                prefixes += session.retained
        self.sessions.show(rows)
        self.no_sessions.display = not rows
        counts = [f"{len(rows) - prefixes} live"] + ([plural(prefixes, "prefix", "prefixes")] if prefixes else [])
        self.live.border_subtitle = " · ".join(counts) if rows else ""
        self.stores.show({node.url: self._store_row(node) for node in self.state.nodes.values()})

    def _session_row(self, node: NodeState, session: SessionInfo, now: float) -> list:
        shown_id = session.session_id if len(session.session_id) <= SHOWN_ID else session.session_id[:SHOWN_ID] + "…"
        left = node.ttl_left(session, now)
        ttl_style = "bold red" if left <= 0 else "yellow" if left < SOON else ""
        # a retained prefix: a finished answer's KV, kept so the next turn that starts with it skips its prefill
        kind = Text("prefix", style="cyan") if session.retained else Text("live")
        return [short_url(node.url), shown_id, kind, str(session.past_len), str(session.start_layer),
                format_bytes(session.bytes), f"{format_duration(node.idle_for(session, now))} ago",
                Text("expiring" if left <= 0 else format_duration(left), style=ttl_style)]

    def _store_row(self, node: NodeState) -> list:
        label = short_url(node.url)
        store = None
        if node.up:
            store = (node.sessions.store if node.sessions else None) or (node.status.store if node.status else None)
        if store is None:
            state = Text("down", style="red") if node.polled else Text("…", style="dim")
            return [label, state, "", "", "", "", ""]
        used = format_bytes(store.bytes)
        if store.max_bytes is not None:
            used += f" of {format_bytes(store.max_bytes)}"
        reasons = " · ".join(f"{reason} {count}" for reason, count in store.evictions.items() if count)
        evicted = str(sum(store.evictions.values())) + (f" ({reasons})" if reasons else "")
        return [label, f"{store.sessions} of {store.max_sessions}", used, format_duration(store.ttl_seconds),
                str(store.hits), str(store.misses), evicted]

    def action_evict(self) -> None:
        """Ask before evicting the selected session: the next decode step on it will cost a re-prefill."""
        key = self.sessions.selected_key
        if key is None:
            self.notify("No session selected.", severity="warning")
            return
        url, session_id = key.split(" ", 1)

        def evict(confirmed: bool | None) -> None:
            if confirmed:
                self.post_message(EvictConfirmed(url, session_id))

        self.app.push_screen(
            ConfirmScreen(f"Evict session {session_id}?",
                          f"from {short_url(url)}. A generation still using it re-prefills once.", "Evict"),
            evict,
        )

    def focus_table(self) -> None:
        self.sessions.focus()
