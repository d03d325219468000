"""The main screen: the four views in tabs, switched by keys or the mouse, and the keys that work anywhere.

"Anywhere" means while the chat's prompt has the focus too: so every binding here has an F-key or a Ctrl
key, which an Input does not take for itself. The digits and letters beside them are shortcuts only where
no text field has the focus (an Input types them).

The first frame holds the Mesh view only. The other views start hidden, so they mount once it is on
screen (:meth:`MainScreen.mount_views`), or at once if the operator switches to one before that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from textual import events
from textual.actions import parse as parse_action
from textual.app import ComposeResult
from textual.binding import Binding
from textual.keys import key_to_character
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, TabbedContent, TabPane

from meshtui.config import ConsoleConfig
from meshtui.messages import PeerChangeRequested
from meshtui.screens.chat import ChatView
from meshtui.screens.help import BindingHelp, HelpScreen
from meshtui.screens.mesh import MeshView
from meshtui.screens.modals import PeerScreen
from meshtui.screens.sessions import SessionsView
from meshtui.screens.throughput import ThroughputView
from meshtui.state import MeshState

VIEWS = {"mesh": "Mesh", "sessions": "Sessions", "throughput": "Throughput", "chat": "Chat"}
VIEW_KEYS = Binding.Group("Views")
PALETTE_HINT_WIDTH = 96  # columns


class MainScreen(Screen):
    """Holds the views; the app redraws them from :class:`MeshState` as messages arrive."""

    AUTO_FOCUS = "#nodes"  # not Textual's first focusable (the tabs): each focus change at start recomposes the footer

    BINDINGS = [
        # one footer entry for the four (the tabs above name them in order); the help screen lists each
        Binding("f2,1", "show_view('mesh')", "Mesh", id="view.mesh", group=VIEW_KEYS),
        Binding("f3,2", "show_view('sessions')", "Sessions", id="view.sessions", group=VIEW_KEYS),
        Binding("f4,3", "show_view('throughput')", "Throughput", id="view.throughput", group=VIEW_KEYS),
        Binding("f5,4", "show_view('chat')", "Chat", id="view.chat", group=VIEW_KEYS),
        # peers, off the footer: the Chat view's keys take its width (the help screen and palette list them)
        Binding("f6,a", "add_peer", "Add peer", id="peer.add", show=False),
        Binding("f7,r", "remove_peer", "Remove peer", id="peer.remove", show=False),
        Binding("f1,question_mark", "help", "Help", id="app.help"),
        # Textual's own copy (a focused Input copies its selection first); given an id so it can be remapped
        Binding("ctrl+c", "copy_text", "Copy", id="app.copy", show=False),
    ]

    def __init__(self, state: MeshState, config: ConsoleConfig, clock: Callable[[], float]) -> None:
        super().__init__()
        self.state = state
        self.config = config
        self.clock = clock
        self.mesh_view = MeshView(state, id="mesh-view")
        self.sessions_view = SessionsView(state, id="sessions-view")
        self.throughput_view = ThroughputView(state, id="throughput-view")
        self.chat_view = ChatView(config.chat, state, id="chat-view")
        self.tabs = TabbedContent(initial="mesh", id="views")
        self._later_views = {"sessions": self.sessions_view, "throughput": self.throughput_view, "chat": self.chat_view}
        # what arrives before a view is mounted is drawn when it mounts: by on_mount, or by mount_views
        self._mesh_ready = False
        self._later_views_mounting = False
        self._later_views_ready = asyncio.Event()
        self._typed_actions = self._actions_on_printable_keys()

    def compose(self) -> ComposeResult:
        yield Header()
        with self.tabs:
            with TabPane(VIEWS["mesh"], id="mesh"):
                yield self.mesh_view
            for view_id in self._later_views:
                yield TabPane(VIEWS[view_id], id=view_id)  # empty until mount_views
        yield Footer()

    def on_resize(self, event: events.Resize) -> None:
        # below this width the command palette's hint would push the chat's keys off the footer (^p still works)
        self.query_one(Footer).show_command_palette = event.size.width >= PALETTE_HINT_WIDTH

    def on_mount(self) -> None:
        self._mesh_ready = True
        self.show_loading()
        self.show_nodes()
        self.show_route()

    async def mount_views(self) -> None:
        """Mount the views the first frame left out, and draw them; a second call waits for the first."""
        if self._later_views_mounting:
            await self._later_views_ready.wait()
            return
        self._later_views_mounting = True
        try:
            if self.is_attached:  # not once the app has begun to exit
                await asyncio.gather(*(self.tabs.get_pane(view_id).mount(view)
                                       for view_id, view in self._later_views.items()))
        finally:
            self._later_views_ready.set()  # a caller waiting for the views must not wait forever
        if self.is_attached:  # the app may have begun to exit while they mounted
            self.show_nodes()

    # ---- redrawing, as the app asks ----------------------------------------------------------------

    def show_nodes(self) -> None:
        now = self.clock()
        if self._mesh_ready:
            self.mesh_view.show_nodes(now)
        if self._later_views_ready.is_set():
            self.sessions_view.show_sessions(now)
            self.throughput_view.show_nodes()

    def show_route(self) -> None:
        if self._mesh_ready:
            self.mesh_view.show_route()

    def show_loading(self) -> None:
        if self._mesh_ready:
            self.mesh_view.show_loading()
            self.mesh_view.show_nodes(self.clock())

    def tick(self) -> None:
        """Countdowns and down-for times move on; nothing else changed."""
        now = self.clock()
        if self._mesh_ready:
            self.mesh_view.show_nodes(now)
        if self._later_views_ready.is_set():
            self.sessions_view.show_sessions(now)

    # ---- views -------------------------------------------------------------------------------------

    async def action_show_view(self, view: str) -> None:
        self.tabs.active = view
        await self._focus_view(view)

    async def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        await self._focus_view(event.pane.id or "mesh")

    async def _focus_view(self, view: str) -> None:
        if view == "mesh":
            self.mesh_view.nodes.focus()
            return
        await self.mount_views()  # at once, if the operator is quicker than the first frame
        if view == "chat":
            self.chat_view.focus_prompt()
        elif view == "sessions":
            self.sessions_view.focus_table()
        else:
            self.throughput_view.generations.focus()

    # ---- peers and help ----------------------------------------------------------------------------

    def action_add_peer(self) -> None:
        def add(url: str | None) -> None:
            if url is not None:
                self.post_message(PeerChangeRequested(url, add=True))

        self.app.push_screen(PeerScreen("add a peer", "Add"), add)

    def action_remove_peer(self) -> None:
        """Offer the node selected on the Mesh view, else the first node that is not the head."""
        head = self.state.head_url
        selected = self.mesh_view.nodes.selected_key
        others = [url for url in self.state.nodes if url != head]
        candidate = selected if selected in others else next(iter(others), "")

        def remove(url: str | None) -> None:
            if url == head:
                self.notify("That is the head: the console cannot remove it.", severity="warning")
            elif url is not None:
                self.post_message(PeerChangeRequested(url, add=False))

        self.app.push_screen(PeerScreen("remove a peer", "Remove", candidate), remove)

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.binding_help(), str(self.config.path) if self.config.path else None))

    def binding_help(self) -> list[BindingHelp]:
        """Every binding with an id, with the keys it has now (after ``[keys]`` in the config).

        A key an Input would type is marked ``*``: it works only where no text field has the focus."""
        rows = []
        for where, bindings in self.binding_sections():
            for binding in bindings:
                keys = [key.strip() for key in self.config.keys.get(binding.id, binding.key).split(",")]
                shown = ", ".join(self.app.get_key_display(Binding(key, binding.action)) + ("*" if typed(key) else "")
                                  for key in keys)
                rows.append(BindingHelp(where, shown, binding.tooltip or binding.description, binding.id))
        return rows

    def remaps_the_prompt_swallows(self) -> list[str]:
        """``[keys]`` entries for keys meant to work while typing whose every key the chat's prompt takes
        for itself (a letter, or one of its own: ``ctrl+e`` moves to the end), so they would do nothing there."""
        prompt_keys = {binding.key for binding in Binding.make_bindings(Input.BINDINGS)}
        swallowed = []
        for where, bindings in self.binding_sections():
            for binding in bindings:
                keys = self.config.keys.get(binding.id)
                if where == "sessions" or keys is None or binding.priority:
                    continue
                if all(typed(key.strip()) or key.strip() in prompt_keys for key in keys.split(",")):
                    swallowed.append(f'{binding.id} = "{keys}"')
        return swallowed

    def binding_sections(self) -> list[tuple[str, list[Binding]]]:
        return [("anywhere", [*self.BINDINGS, *self.app.BINDINGS]), ("sessions", SessionsView.BINDINGS),
                ("chat", ChatView.BINDINGS)]

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # a focused Input takes printable keys for itself: don't advertise bindings it would swallow
        if isinstance(self.focused, Input) and (action, parameters) in self._typed_actions:
            return False
        return True

    def _actions_on_printable_keys(self) -> set[tuple[str, tuple]]:
        """Actions remapped (in ``[keys]``) to printable keys only: while an Input has the focus, none works."""
        only_typed = set()
        for binding in self.BINDINGS:
            keys = self.config.keys.get(binding.id, binding.key).split(",")
            if all(typed(key.strip()) for key in keys):
                _, name, parameters = parse_action(binding.action)
                only_typed.add((name, parameters))
        return only_typed


def typed(key: str) -> bool:
    """Whether a focused Input takes ``key`` as text (``1``, ``a``, ``question_mark``), so no binding sees it."""
    character = key_to_character(key)
    return character is not None and character.isprintable()
