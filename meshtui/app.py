"""meshtui: the operator console of a meshnet mesh.

The app owns the I/O: one polling worker, the chat stream, evictions and peer changes, each in a
worker that posts messages (``meshtui.messages``). Handlers fold those into :class:`MeshState` and
ask the views to redraw; views never touch the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.worker import Worker

from meshtui.client import DaemonClient, DaemonError
from meshtui.config import ConsoleConfig, default_export_dir, normalize_url
from meshtui.export import conversation_record, write_export
from meshtui.messages import (
    CancelRequested,
    ChatSettingsChanged,
    EvictConfirmed,
    ExportRequested,
    GenerationChunk,
    GenerationEnded,
    LocalMeshFailed,
    LocalMeshReady,
    LocalProgress,
    NewConversationRequested,
    NodePolled,
    PeerChangeRequested,
    PromptSubmitted,
    RoutePolled,
    SystemPromptChanged,
)
from meshtui.screens.main import VIEWS, MainScreen
from meshtui.state import MeshState
from meshtui.widgets.formatting import home_relative, short_url


class MeshApp(App[None]):
    CSS_PATH = "meshtui.tcss"
    TITLE = "meshtui"

    # Ctrl+C copies, as in every Textual 8 app (with nothing selected, Textual says which key quits)
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True, show=False)]

    main: MainScreen  # the views, once the app runs

    def __init__(
        self,
        config: ConsoleConfig,
        *,
        head_url: str | None = None,
        peer_urls: Sequence[str] = (),
        local_mesh=None,
        poll: bool = True,
        clock: Callable[[], float] = time.time,
        token: str | None = None,
        export_dir: Path | None = None,
    ) -> None:
        """``token``: the mesh token sent on every request (the command line resolves it with
        :meth:`ConsoleConfig.mesh_token`: ``MESHNET_TOKEN``, else the config file's ``token``).
        ``export_dir``: where exported conversations go (default: the platformdirs data folder's)."""
        super().__init__()
        self.config = config
        self.export_dir = export_dir or default_export_dir()
        self.local_mesh = local_mesh
        self.poll = poll
        self.clock = clock
        self.client = DaemonClient(token=token)
        self.state = MeshState(starting=local_mesh is not None, system_prompt=config.system_prompt or "")
        if head_url:
            self.state.set_head(normalize_url(head_url))
        for url in [*peer_urls, *config.peers]:
            self.state.add_node(normalize_url(url))
        self._poll_now = asyncio.Event()
        self._answer: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def get_default_screen(self) -> Screen:
        # built here, not in __init__: widgets measure themselves against the running app
        self.main = MainScreen(self.state, self.config, self.clock)
        return self.main

    def on_mount(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._apply_keys()
        if self.config.theme:
            if self.config.theme in self.available_themes:
                self.theme = self.config.theme
            else:
                self.say(f"Unknown theme {self.config.theme!r} in the config.", severity="warning")
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        self._show_head()
        self.set_interval(1.0, self.tick)
        if self.local_mesh is not None:
            self._start_local_mesh()

    def on_ready(self) -> None:
        # the first frame is on screen and its footer fills in one refresh later; after that, what the
        # frame did not need: the other views, and the first poll (which loads aiohttp, a third of a second)
        self.call_after_refresh(self.call_after_refresh, self._after_first_frame)

    async def _after_first_frame(self) -> None:
        await self.main.mount_views()
        if self.local_mesh is None and self.poll:
            self._poll_forever()

    def _apply_keys(self) -> None:
        known = {b.id for _, bindings in self.main.binding_sections() for b in bindings if b.id}
        unknown = sorted(set(self.config.keys) - known)
        if unknown:
            self.say(f"Unknown binding ids in [keys]: {', '.join(unknown)}", severity="warning")
        self.set_keymap({k: v for k, v in self.config.keys.items() if k in known})
        swallowed = self.main.remaps_the_prompt_swallows()
        if swallowed:
            self.say(f"In [keys], {'; '.join(swallowed)}: the chat's prompt takes these keys while it has the focus. "
                     "Add an F-key or a free Ctrl key, e.g. \"f5,c\".", severity="warning")

    async def on_unmount(self) -> None:
        self._stop_local_mesh()
        await self.client.close()

    async def action_quit(self) -> None:
        self._stop_local_mesh()
        self.exit()

    def _stop_local_mesh(self) -> None:
        if self.local_mesh is not None:
            self.local_mesh.stop()

    # ---- polling ---------------------------------------------------------------------------------

    @work(exclusive=True, group="poll")
    async def _poll_forever(self) -> None:
        """Poll every node and the head's route; the next round starts only once this one has finished."""
        while True:
            self._poll_now.clear()
            await asyncio.gather(*(self._poll_node(url) for url in self.state.node_urls()), self._poll_route())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poll_now.wait(), self.config.poll_seconds)

    async def _poll_node(self, url: str) -> None:
        status, sessions = await asyncio.gather(self.client.status(url), self.client.sessions(url),
                                                return_exceptions=True)
        failure = next((r for r in (status, sessions) if isinstance(r, Exception)), None)
        if failure is not None and not isinstance(failure, DaemonError):
            failure = DaemonError(f"{failure.__class__.__name__}: {failure}")
        self.post_message(NodePolled(
            url,
            None if isinstance(status, BaseException) else status,
            None if isinstance(sessions, BaseException) else sessions,
            None if failure is None else str(failure),
            None if failure is None else failure.status,
        ))

    async def _poll_route(self) -> None:
        if self.state.head_url is None:
            return
        try:
            self.post_message(RoutePolled(await self.client.route(self.state.head_url)))
        except DaemonError as exc:
            self.post_message(RoutePolled(None, str(exc)))

    def poll_soon(self) -> None:
        """Start the next poll now instead of when the interval ends."""
        self._poll_now.set()

    def on_node_polled(self, message: NodePolled) -> None:
        self.state.record_poll(message.url, message.status, message.sessions, message.error, self.clock(),
                               http_status=message.http_status)
        self.main.show_nodes()

    def on_route_polled(self, message: RoutePolled) -> None:
        self.state.record_route(message.route, message.error)
        self.main.show_route()

    def tick(self) -> None:
        """Once a second: TTL countdowns and down-for times move on the local clock, no network."""
        self.main.tick()

    def _show_head(self) -> None:
        head = self.state.head_url
        if head:
            self.sub_title = f"head {short_url(head)}"
        else:
            self.sub_title = "starting a local mesh" if self.state.starting else "no head"

    # ---- a local mesh started for us ---------------------------------------------------------------

    @work(exclusive=True, group="local-mesh")
    async def _start_local_mesh(self) -> None:
        try:
            await self.local_mesh.start(self._local_progress)
        except Exception as exc:  # noqa: BLE001 - whatever stopped the daemons is shown in the loading panel
            self.post_message(LocalMeshFailed(str(exc) or exc.__class__.__name__))
            return
        self.post_message(LocalMeshReady(self.local_mesh.head_url, list(self.local_mesh.urls)))

    def _local_progress(self, node: str, line: str) -> None:
        message = LocalProgress(node, line)
        if self._loop is None or threading.get_ident() == self._loop_thread:
            self.post_message(message)
        else:  # the mesh may read its children's output on a thread
            self._loop.call_soon_threadsafe(self.post_message, message)

    def on_local_progress(self, message: LocalProgress) -> None:
        self.state.add_loading_line(message.node, message.line)
        self.main.show_loading()

    def on_local_mesh_ready(self, message: LocalMeshReady) -> None:
        self.state.starting = False
        self.state.set_head(message.head_url)
        for url in message.urls:
            self.state.add_node(url)
        self._show_head()
        self.main.show_loading()
        self.main.show_nodes()
        if self.poll:
            self._poll_forever()

    def on_local_mesh_failed(self, message: LocalMeshFailed) -> None:
        self.state.starting = False
        self.state.loading_error = message.error
        self.main.show_loading()

    # ---- chat ------------------------------------------------------------------------------------

    async def on_prompt_submitted(self, message: PromptSubmitted) -> None:
        if self.state.head_url is None:
            self.say("No head node to ask: the mesh has no head yet.", severity="error")
            return
        if self._answer is not None and self._answer.is_running:
            self.say("An answer is still streaming: cancel it first.", severity="warning")
            return
        params = self.config.chat.params()
        cap = self.state.chat_limits.max_tokens
        if cap is not None and params["max_tokens"] > cap:  # settings saved against another head
            self.say(f"max tokens {params['max_tokens']} is past the head's cap: asking for {cap}.",
                     severity="warning")
            params["max_tokens"] = cap
        messages = self.state.request_messages(message.text)
        record = self.state.start_generation(message.text, self.clock())
        await self.main.chat_view.begin(record)
        self.main.throughput_view.show_generation(record)
        self._answer = self._stream_answer(record.number, self.state.head_url, messages, params)

    @work(exclusive=True, group="chat")
    async def _stream_answer(self, number: int, head_url: str, messages: list[dict], params: dict) -> None:
        try:
            # aclosing: a cancelled answer closes its HTTP stream at once, which ends the generation on the head
            async with contextlib.aclosing(self.client.chat_stream(head_url, messages, **params)) as chunks:
                async for chunk in chunks:
                    self.post_message(GenerationChunk(number, chunk, self.clock()))
        except asyncio.CancelledError:
            self.post_message(GenerationEnded(number, "cancelled"))
            raise
        except DaemonError as exc:
            self.post_message(GenerationEnded(number, "failed", str(exc)))
        else:
            self.post_message(GenerationEnded(number, "done"))

    async def on_generation_chunk(self, message: GenerationChunk) -> None:
        record = self.state.generation(message.number)
        if record is None or record.finished:
            return
        if message.chunk.text:
            record.add_text(message.chunk.text, message.arrived_at)
        if message.chunk.stats:
            record.stats = message.chunk.stats
        if message.chunk.usage:
            record.usage = message.chunk.usage
        await self.main.chat_view.append(record, message.chunk.text)
        self.main.throughput_view.show_generation(record)

    async def on_generation_ended(self, message: GenerationEnded) -> None:
        record = self.state.generation(message.number)
        if record is None or record.finished:
            return
        self.state.finish_generation(record, message.outcome, message.error)
        await self.main.chat_view.finish(record)
        self.main.throughput_view.show_generation(record)
        self.poll_soon()  # the answer left sessions behind on every hop

    def on_cancel_requested(self, message: CancelRequested) -> None:
        self.cancel_answer()

    def cancel_answer(self) -> None:
        if self._answer is not None and self._answer.is_running:
            self._answer.cancel()

    async def on_new_conversation_requested(self, message: NewConversationRequested) -> None:
        await self.new_conversation()

    async def new_conversation(self) -> None:
        """Cancel the answer in flight, forget the turns and clear the pane; the system prompt stays."""
        self.cancel_answer()  # its end arrives later, and is left out of the new conversation
        self.state.new_conversation()
        await self.main.mount_views()
        await self.main.chat_view.clear()
        self.say("New conversation." + (" The system prompt stays." if self.state.system_prompt else ""))

    def on_system_prompt_changed(self, message: SystemPromptChanged) -> None:
        self.state.system_prompt = message.text
        self.config.system_prompt = message.text or None  # kept for the next start
        self._save_config()
        self.main.chat_view.show_system_prompt()
        self.say("System prompt set: it goes first in the next request." if message.text else
                 "System prompt cleared.")

    def on_export_requested(self, message: ExportRequested) -> None:
        self.export_conversation()

    def export_conversation(self) -> tuple[Path, Path] | None:
        """Write the conversation as Markdown and JSON into the export folder, and say where."""
        if not self.state.conversation_records:
            self.say("Nothing to export yet: the conversation has no answers.", severity="warning")
            return None
        now = self.clock()
        record = conversation_record(self.state, self.config.chat, now)
        try:
            paths = write_export(self.export_dir, record, now)
        except OSError as exc:
            self.say(f"Could not export to {self.export_dir}: {exc}", severity="error")
            return None
        markdown, data = paths
        self.say(f"Exported {markdown.name} and {data.name} to {home_relative(markdown.parent)}")
        return paths

    def on_chat_settings_changed(self, message: ChatSettingsChanged) -> None:
        self.config.chat = message.settings
        self._save_config()
        self.main.chat_view.show_settings(message.settings)

    # ---- evictions and peers ---------------------------------------------------------------------

    def on_evict_confirmed(self, message: EvictConfirmed) -> None:
        self._evict(message.url, message.session_id)

    @work(group="evict")
    async def _evict(self, url: str, session_id: str) -> None:
        try:
            await self.client.evict(url, session_id)
        except DaemonError as exc:
            self.say(f"Could not evict {session_id} from {short_url(url)}: {exc}", severity="error")
            return
        node = self.state.nodes.get(url)
        if node is not None:
            node.forget_session(session_id)
        self.main.show_nodes()
        self.say(f"Evicted {session_id} from {short_url(url)}.")
        self.poll_soon()

    def on_peer_change_requested(self, message: PeerChangeRequested) -> None:
        self._change_peer(message.url, add=message.add)

    @work(group="peers")
    async def _change_peer(self, url: str, *, add: bool) -> None:
        """Remember the peer in the config file and tell the head, so its routes include (or drop) it."""
        if add:
            self.config.add_peer(url)
            self.state.add_node(url)
        else:
            self.config.remove_peer(url)
            self.state.remove_node(url)
        self.main.show_nodes()
        head = self.state.head_url
        verb = "Added" if add else "Removed"
        if head is not None and head != url:
            try:
                await (self.client.add_peer(head, url) if add else self.client.remove_peer(head, url))
            except DaemonError as exc:
                self.say(f"{verb} {short_url(url)} in the config; the head said: {exc}", severity="warning")
                self.poll_soon()
                return
        self.say(f"{verb} peer {short_url(url)}.")
        self.poll_soon()

    # ---- the command palette and the config file ---------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        main = self.main
        for view_id, title in VIEWS.items():
            yield SystemCommand(f"Show {title}", f"Switch to the {title} view",
                                lambda view_id=view_id: main.action_show_view(view_id))
        yield SystemCommand("Evict session", "Evict the session selected in the Sessions view",
                            main.sessions_view.action_evict)
        yield SystemCommand("Cancel answer", "Stop the answer being streamed", self.cancel_answer)
        yield SystemCommand("Sampling settings", "Temperature, top_p, top_k, max tokens, seed",
                            main.chat_view.action_settings)
        yield SystemCommand("New chat", "Start a new conversation (cancels an answer in flight)",
                            self.new_conversation)
        yield SystemCommand("System prompt", "Set the conversation's system prompt",
                            main.chat_view.action_system_prompt)
        yield SystemCommand("Export chat", "Write the conversation as Markdown and JSON", self.export_conversation)
        yield SystemCommand("Add peer", "Add a daemon to the config and the head's peers", main.action_add_peer)
        yield SystemCommand("Remove peer", "Remove a daemon from the config and the head's peers",
                            main.action_remove_peer)
        yield SystemCommand("Poll now", "Ask every node for its status now", self.poll_soon)
        yield SystemCommand("Key bindings", "Every key and its id for [keys] in the config", main.action_help)

    def _remember_theme(self, theme) -> None:
        if theme.name != self.config.theme:
            self.config.theme = theme.name
            self._save_config()

    def say(self, message: str, severity: str = "information") -> None:
        """A notification; never parsed as markup, since it often quotes a daemon's words."""
        self.notify(message, severity=severity, markup=False)

    def _save_config(self) -> None:
        if self.config.path is not None:  # a config built in code (tests) has no file to write
            self.config.save()
