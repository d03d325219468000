"""The console driven by keys against fake daemons on 127.0.0.1: chat, cancel, evict, peers, keys, down/up, the token.

The fake daemons are meshd's real application over a fake node (``tests.support.tui_data``): it records what the
console asked of it, so these tests run the console's real HTTP client without loading a model.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from textual.command import CommandList, CommandPalette
from textual.pilot import Pilot
from textual.selection import Selection
from textual.widgets import Footer, Input, Markdown, Static, TabbedContent, TextArea
from textual.worker import WorkerState

from meshtui.app import MeshApp
from meshtui.client import UNAUTHORIZED
from meshtui.config import ConsoleConfig
from meshtui.messages import NodePolled, RoutePolled
from meshtui.screens.help import HelpScreen
from meshtui.screens.modals import ConfirmScreen, PeerScreen, SystemPromptScreen
from meshtui.screens.settings import ChatSettingsScreen
from meshtui.widgets.keyed_table import KeyedTable
from tests.support.meshd import start_mesh
from tests.support.tui_data import (
    HEAD,
    HEAD_SESSIONS,
    MODEL,
    NOW,
    TOKEN,
    WORKER_SESSIONS,
    FakeDaemon,
    FrozenClock,
    node_status,
    session,
    session_list,
)

SIZE = (100, 32)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def daemons():
    """``await daemons(start, end, ...)`` -> a started :class:`FakeDaemon`, stopped at teardown."""
    started: list[FakeDaemon] = []

    async def start(*args, **kwargs) -> FakeDaemon:
        daemon = FakeDaemon(*args, **kwargs)
        await daemon.start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        await daemon.stop()


async def wait_until(pilot: Pilot, condition, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def text_of(widget: Static) -> str:
    return str(widget.render())


def saving_app(head_url: str, tmp_path: Path) -> MeshApp:
    """A console on ``head_url`` whose config is a file in ``tmp_path``: what it saves can be read back."""
    return MeshApp(ConsoleConfig(path=tmp_path / "meshtui.toml"), head_url=head_url, poll=False, clock=FrozenClock())


async def ask(pilot: Pilot, prompt: str) -> None:
    app: MeshApp = pilot.app
    if app.query_one(TabbedContent).active != "chat":
        await pilot.press("4")
    await pilot.press(*prompt, "enter")


async def test_prompt_streams_an_answer_and_keeps_the_conversation(daemons):
    head = await daemons(0, 30)
    app = MeshApp(ConsoleConfig(), head_url=head.url, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        await wait_until(pilot, lambda: app.state.generations and app.state.generations[-1].finished, "the answer")
        first = app.state.generations[-1]
        assert (first.outcome, first.text) == ("done", "Hello from the **mesh**.")
        assert app.main.chat_view.query(Markdown).last().source == first.text
        stats = text_of(app.main.chat_view.query(".answer-stats").last())
        assert "4 tokens" in stats and "42.0 tok/s" in stats and "0 cache misses" in stats
        request = head.chat_requests[-1]
        assert request["messages"] == [{"role": "user", "content": "hi"}]
        assert request["stream"] is True and request["temperature"] == 0.0 and request["max_tokens"] == 256

        await ask(pilot, "more")
        await wait_until(pilot, lambda: len(app.state.generations) == 2 and app.state.generations[-1].finished,
                         "the second answer")
        assert head.chat_requests[-1]["messages"] == [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello from the **mesh**."},
            {"role": "user", "content": "more"},
        ]


async def test_the_chat_footer_says_how_much_of_the_prompt_the_mesh_reused(daemons):
    head = await daemons(0, 30)  # keeps each finished answer as a prefix, as the real head does
    app = MeshApp(ConsoleConfig(), head_url=head.url, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await app.main.mount_views()
        status = app.main.chat_view.query_one("#chat-status", Static)
        assert "reused" not in text_of(status)  # no answer yet
        await ask(pilot, "hi")
        # "hi" is 5 tokens to the fake head, and nothing was held before it
        await wait_until(pilot, lambda: text_of(status).startswith("reused 0 of 5 prompt tokens · temperature 0 "),
                         "the first answer's footer")

        await ask(pilot, "more")
        # the first turn and its answer (13 tokens) were held; only "more" was computed
        await wait_until(pilot, lambda: text_of(status).startswith("reused 13 of 18 prompt tokens · temperature 0 "),
                         "the second answer's footer")
        second = app.state.generations[-1]
        assert (second.usage.cached_tokens, second.stats.cached_tokens) == (13, 13)
        assert "seed random" in text_of(status)  # the sampling settings stay in the footer


async def test_escape_cancels_a_streaming_answer(daemons):
    head = await daemons(0, 30, answer=[f" t{i}" for i in range(10)], hold_after=3)
    app = MeshApp(ConsoleConfig(), head_url=head.url, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "count")
        await wait_until(pilot, lambda: app.state.generations and len(app.state.generations[0].chunk_times) == 3,
                         "three tokens")
        (worker,) = [w for w in app.workers if w.group == "chat"]
        assert "answering #1" in text_of(app.main.chat_view.query_one("#chat-status"))
        assert app.screen.active_bindings["escape"].binding.id == "chat.cancel"  # in the footer while it streams
        await pilot.press("escape")
        record = app.state.generations[0]
        await wait_until(pilot, lambda: record.finished, "the cancellation")
        assert app.screen.active_bindings["escape"].binding.id == "chat.leave"  # and out of it again
        assert record.outcome == "cancelled"
        assert worker.state == WorkerState.CANCELLED
        assert text_of(app.main.chat_view.query(".answer-stats").last()) == "cancelled after 3 tokens"
        await wait_until(pilot, head.client_left.is_set, "the head to see the stream closed")
        # the partial answer stays in the conversation: it is what the operator saw
        assert app.state.conversation[-1] == {"role": "assistant", "content": " t0 t1 t2"}


async def test_evict_asks_first_then_evicts_on_the_right_node(daemons):
    shared_id = WORKER_SESSIONS[0].session_id  # the same generation's session lives on both nodes
    worker = await daemons(15, 30, sessions=WORKER_SESSIONS)
    head = await daemons(0, 15, peers=[worker.url], sessions=HEAD_SESSIONS)
    app = MeshApp(ConsoleConfig(poll_seconds=0.2), head_url=head.url, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await app.main.mount_views()  # mounted after the first frame, which shows only the Mesh view
        table = app.main.sessions_view.query_one("#sessions", KeyedTable)
        await wait_until(pilot, lambda: table.row_count == 3, "three sessions from two nodes")
        await pilot.press("2")
        table.move_cursor(row=table.get_row_index(f"{worker.url} {shared_id}"))

        await pilot.press("e")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen) and worker.deleted == []

        await pilot.press("e", "y")
        await wait_until(pilot, lambda: worker.deleted == [shared_id], "the eviction")
        assert head.deleted == []
        await wait_until(pilot, lambda: table.row_count == 2, "the evicted row to go")
        assert f"{head.url} {shared_id}" in [row.value for row in table.rows]


async def test_add_and_remove_a_peer_write_the_config_and_tell_the_head(daemons, tmp_path):
    head = await daemons(0, 30)
    app = saving_app(head.url, tmp_path)
    config = app.config
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a")
        assert isinstance(app.screen, PeerScreen)
        await pilot.press(*"127.0.0.1:7999", "enter")
        await wait_until(pilot, lambda: head.peer_requests, "the head to hear of the peer")
        assert head.peer_requests == [("add", "http://127.0.0.1:7999")]
        assert ConsoleConfig.load(config.path).peers == ["http://127.0.0.1:7999"]
        assert "http://127.0.0.1:7999" in app.state.nodes

        await pilot.press("r")  # offers the one configured peer
        assert app.screen.query_one(Input).value == "http://127.0.0.1:7999"
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(head.peer_requests) == 2, "the removal")
        assert head.peer_requests[-1] == ("remove", "http://127.0.0.1:7999")
        assert ConsoleConfig.load(config.path).peers == []
        assert "http://127.0.0.1:7999" not in app.state.nodes


async def test_sampling_settings_are_saved_and_used(daemons, tmp_path):
    head = await daemons(0, 30)
    app = saving_app(head.url, tmp_path)
    config = app.config
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("4", "ctrl+s")
        assert isinstance(app.screen, ChatSettingsScreen)
        app.screen.query_one("#temperature", Input).value = "3"
        await pilot.click("#save")
        assert isinstance(app.screen, ChatSettingsScreen)  # out of range: the dialog says so and stays
        assert "between 0.0 and 2.0" in text_of(app.screen.query_one("#problem"))
        temperature = app.screen.query_one("#temperature", Input)
        temperature.value = "0.7"
        app.screen.query_one("#seed", Input).value = "42"
        temperature.focus()
        await pilot.press("enter")  # Enter in any field saves too
        assert ConsoleConfig.load(config.path).chat.temperature == 0.7
        await ask(pilot, "hi")
        await wait_until(pilot, lambda: head.chat_requests, "the request")
        assert head.chat_requests[0]["temperature"] == 0.7 and head.chat_requests[0]["seed"] == 42


async def test_the_sampling_dialog_is_bounded_by_the_heads_cap(daemons):
    head = await daemons(0, 30)
    config = ConsoleConfig()
    config.chat.max_tokens = 5000  # saved against another head, or by hand
    app = MeshApp(config, head_url=head.url, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5", "ctrl+s")
        limits = text_of(app.screen.query_one("#limits"))
        assert "has not said" in limits  # no status yet: the head refuses too many itself
        await pilot.press("escape")
        app.post_message(NodePolled(head.url, node_status(head.url, 0, 30, max_tokens_cap=512, context_length=2048),
                                    session_list([])))
        await pilot.pause()
        await pilot.press("ctrl+s")
        dialog = app.screen
        assert isinstance(dialog, ChatSettingsScreen)
        assert text_of(dialog.query_one("#limits")) == ("The head allows up to 512 new tokens per answer, "
                                                        "prompt and answer within 2048 tokens.")
        await pilot.click("#save")
        assert app.screen is dialog
        assert text_of(dialog.query_one("#problem")) == "max tokens must be between 1 and 512: the head's cap"
        await pilot.press("escape")
        await ask(pilot, "hi")  # what was saved before is cut to the cap, and the operator told
        await wait_until(pilot, lambda: head.chat_requests, "the request")
        assert head.chat_requests[0]["max_tokens"] == 512
        assert any("past the head's cap" in n.message for n in app._notifications)
        await wait_until(pilot, lambda: app.state.generations[-1].finished, "the answer")
        await pilot.press("ctrl+s")
        app.screen.query_one("#max_tokens", Input).value = "512"
        await pilot.click("#save")
        assert not isinstance(app.screen, ChatSettingsScreen) and app.config.chat.max_tokens == 512


async def test_ttl_countdown_ticks_on_the_local_clock():
    clock = FrozenClock()
    app = MeshApp(ConsoleConfig(), head_url=HEAD, poll=False, clock=clock)
    node_clock_ahead = 100.0  # the daemon's clock runs 100 s ahead of ours: only its own times matter
    node_now = NOW + node_clock_ahead
    sessions = [session("5d1e0c9a7b3f2e4d6c8a0b1c", 48, 0, idle=3, ttl_left=597, time=node_now)]
    async with app.run_test(size=SIZE) as pilot:
        await app.main.mount_views()
        app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 30), session_list(sessions, time=node_now)))
        await pilot.pause()
        table = app.main.sessions_view.query_one("#sessions", KeyedTable)
        key = f"{HEAD} 5d1e0c9a7b3f2e4d6c8a0b1c"
        assert str(table.get_cell(key, "ttl")) == "9m 57s"
        assert str(table.get_cell(key, "used")) == "3s ago"
        clock.advance(5)
        app.tick()
        await pilot.pause()
        assert str(table.get_cell(key, "ttl")) == "9m 52s"
        assert str(table.get_cell(key, "used")) == "8s ago"
        clock.advance(600)
        app.tick()
        await pilot.pause()
        assert str(table.get_cell(key, "ttl")) == "expiring"


async def test_sessions_tell_retained_prefixes_from_live_sessions():
    clock = FrozenClock()
    app = MeshApp(ConsoleConfig(), head_url=HEAD, poll=False, clock=clock)
    live, prefix = (f"{HEAD} {s.session_id}" for s in HEAD_SESSIONS)
    async with app.run_test(size=SIZE) as pilot:
        await app.main.mount_views()
        app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 30), session_list(HEAD_SESSIONS)))
        await pilot.pause()
        view = app.main.sessions_view
        table = view.query_one("#sessions", KeyedTable)
        assert [str(table.get_cell(live, c)) for c in ("kind", "past", "ttl")] == ["live", "48", "9m 57s"]
        assert [str(table.get_cell(prefix, c)) for c in ("kind", "past", "ttl")] == ["prefix", "212", "55s"]
        assert view.live.border_subtitle == "1 live · 1 prefix"
        clock.advance(5)  # a prefix expires like any session: its countdown ticks too
        app.tick()
        await pilot.pause()
        assert str(table.get_cell(prefix, "ttl")) == "50s"


async def test_a_node_that_stops_answering_shows_down_and_comes_back(daemons):
    worker = await daemons(15, 30)
    head = await daemons(0, 15, peers=[worker.url])  # the console learns of the worker from the head
    app = MeshApp(ConsoleConfig(poll_seconds=0.2), head_url=head.url)
    async with app.run_test(size=SIZE) as pilot:
        nodes = app.main.mesh_view.query_one("#nodes", KeyedTable)

        def state_of(url: str) -> str:
            return str(nodes.get_cell(url, "state")) if url in [r.value for r in nodes.rows] else ""

        await wait_until(pilot, lambda: state_of(worker.url) == "● up", "the worker up")
        await worker.stop()
        await wait_until(pilot, lambda: state_of(worker.url) == "✕ down", "the worker down")
        assert state_of(head.url) == "● up"
        assert "connection refused" in text_of(app.main.mesh_view.query_one("#node-errors"))
        await worker.start()
        await wait_until(pilot, lambda: state_of(worker.url) == "● up", "the worker back up")


async def test_the_console_sends_the_mesh_token_on_every_request(daemons):
    worker = await daemons(15, 30, token=TOKEN)
    head = await daemons(0, 15, peers=[worker.url], token=TOKEN, stats={"failovers": 1, "reprefills": 1})
    app = MeshApp(ConsoleConfig(poll_seconds=0.2), head_url=head.url, token=TOKEN)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: all(app.state.nodes[d.url].up for d in (head, worker)), "both nodes up")
        await wait_until(pilot, lambda: app.state.route is not None, "the route")
        await ask(pilot, "hi")
        await wait_until(pilot, lambda: app.state.generations and app.state.generations[-1].finished, "the answer")
        assert app.state.generations[-1].outcome == "done"
        # the answer moved once mid-way: its footer says so, and says nothing of reroutes, which did not happen
        stats = text_of(app.main.chat_view.query(".answer-stats").last())
        assert "1 failover" in stats and "reroute" not in stats
    asked = {path for path, _ in head.authorizations} | {path for path, _ in worker.authorizations}
    assert {"/v1/status", "/v1/sessions", "/v1/route", "/v1/chat/completions"} <= asked
    assert {given for _, given in head.authorizations + worker.authorizations} == {f"Bearer {TOKEN}"}


async def test_the_throughput_view_shows_how_many_drafted_tokens_were_accepted(daemons):
    head = await daemons(0, 30, stats={"drafted_tokens": 40, "accepted_tokens": 30, "verify_steps": 12})
    app = MeshApp(ConsoleConfig(poll_seconds=0.2), head_url=head.url)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.nodes[head.url].up, "the node up")
        await ask(pilot, "hi")
        await wait_until(pilot, lambda: app.state.generations and app.state.generations[-1].finished, "the answer")
        await pilot.press("f4")
        await pilot.pause()
        assert "75% of 40 drafted tokens accepted" in text_of(app.main.throughput_view.latest_stats)


async def test_a_node_that_refuses_the_token_says_so(daemons):
    head = await daemons(0, 30, token=TOKEN)
    app = MeshApp(ConsoleConfig(poll_seconds=0.2), head_url=head.url)  # no token
    async with app.run_test(size=SIZE) as pilot:
        nodes = app.main.mesh_view.nodes
        await wait_until(pilot, lambda: app.state.nodes[head.url].polled, "the first poll")
        assert str(nodes.get_cell(head.url, "state")) == "✕ 401"
        assert text_of(app.main.mesh_view.query_one("#node-errors")) == f"{head.url[7:]}: {UNAUTHORIZED}"
        await wait_until(pilot, lambda: app.state.route_error is not None, "the route poll")
        assert UNAUTHORIZED in text_of(app.main.mesh_view.query_one("#route-error"))
        await ask(pilot, "hi")
        await wait_until(pilot, lambda: app.state.generations and app.state.generations[-1].finished, "the refusal")
        assert text_of(app.main.chat_view.query(".answer-stats").last()) == f"failed: {UNAUTHORIZED}"
    assert head.chat_requests == [] and {given for _, given in head.authorizations} == {None}


async def test_node_rows_keep_the_configured_order_whichever_node_answers_first():
    first_peer, second_peer = "http://10.0.0.2:7071", "http://10.0.0.1:7071"
    learned = "http://10.0.0.3:7071"  # configured nowhere: the head reports it as a peer
    app = MeshApp(ConsoleConfig(peers=[first_peer, second_peer]), head_url=HEAD, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(NodePolled(second_peer, node_status(second_peer, 20, 30), session_list([])))
        app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 10, peers=[learned, second_peer, first_peer]),
                                    session_list([])))
        app.post_message(NodePolled(learned, node_status(learned, 10, 20), session_list([])))
        app.post_message(NodePolled(first_peer, node_status(first_peer, 10, 20), session_list([])))
        await pilot.pause()
        nodes = app.main.mesh_view.nodes
        assert [row.key.value for row in nodes.ordered_rows] == [HEAD, first_peer, second_peer, learned]
        assert all(str(nodes.get_cell(url, "state")) == "● up" for url in app.state.nodes)


async def test_a_tab_clicked_at_once_shows_its_view_with_the_focus():
    """The views besides Mesh mount just after the first frame; a click quicker than that mounts them at once."""
    app = MeshApp(ConsoleConfig(), head_url=HEAD, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.click("#--content-tab-chat")
        assert app.query_one(TabbedContent).active == "chat"
        await wait_until(pilot, lambda: app.screen.focused is app.main.chat_view.prompt, "the prompt's focus")
        await pilot.click("#--content-tab-sessions")
        await wait_until(pilot, lambda: app.screen.focused is app.main.sessions_view.sessions, "the table's focus")


async def test_a_narrow_terminal_drops_the_palette_hint_so_the_chat_keys_fit():
    app = MeshApp(ConsoleConfig(), head_url=HEAD, poll=False, clock=FrozenClock())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f5")
        footer = app.main.query_one(Footer)
        assert not footer.show_command_palette
        await pilot.resize_terminal(120, 30)
        await wait_until(pilot, lambda: footer.show_command_palette, "the hint back on a wide terminal")
        await pilot.press("ctrl+p")  # the palette itself opens at any width
        assert isinstance(app.screen, CommandPalette)


async def test_keys_remapped_in_the_config_work_and_show():
    config = ConsoleConfig(keys={"view.sessions": "ctrl+g,s", "session.evict": "x"})
    app = MeshApp(config, head_url=HEAD, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        tabs = app.query_one(TabbedContent)
        await pilot.press("2", "f3")
        assert tabs.active == "mesh"  # the default keys are gone
        await pilot.press("s")
        assert tabs.active == "sessions"
        shown = {key: active.binding.id for key, active in app.screen.active_bindings.items()}
        assert shown.get("ctrl+g") == "view.sessions" and shown.get("x") == "session.evict"
        help_rows = {row.binding_id: row.keys for row in app.main.binding_help()}
        assert help_rows["view.sessions"] == "^g, s*" and help_rows["session.evict"] == "x*"
        await pilot.press("f5")
        await wait_until(pilot, lambda: app.screen.focused is app.main.chat_view.prompt, "the prompt's focus")
        await pilot.press("s", "ctrl+g")  # the letter is typed; the Ctrl key switches
        assert app.main.chat_view.prompt.value == "s" and tabs.active == "sessions"


async def test_views_help_and_peers_answer_their_keys_while_the_prompt_has_the_focus():
    app = MeshApp(ConsoleConfig(), head_url=HEAD, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        tabs = app.query_one(TabbedContent)
        await pilot.press("f5")
        prompt = app.main.chat_view.prompt
        await wait_until(pilot, lambda: app.screen.focused is prompt, "the prompt's focus")
        await pilot.press(*"1a?r2")  # the printable shortcuts are the operator's text here
        assert prompt.value == "1a?r2" and tabs.active == "chat" and app.screen is app.main
        for key, view in (("f3", "sessions"), ("f5", "chat"), ("f4", "throughput"), ("f5", "chat"), ("f2", "mesh")):
            await pilot.press(key)
            assert tabs.active == view
            if view == "chat":
                await wait_until(pilot, lambda: app.screen.focused is prompt, "the prompt's focus")
        await pilot.press("f5")
        await wait_until(pilot, lambda: app.screen.focused is prompt, "the prompt's focus")
        # the footer offers the keys that work here: F-keys and Ctrl keys, never a letter the prompt takes
        shown = {key for key, active in app.screen.active_bindings.items() if active.binding.show}
        assert {"f1", "f2", "f3", "f4", "f5", "ctrl+n", "ctrl+t", "ctrl+s", "ctrl+o"} <= shown
        assert not any(len(key) == 1 for key in shown)
        assert "escape" not in shown  # nothing streams: Escape leaves the prompt, and the footer keeps its room
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        rows = {row.binding_id: (row.where, row.keys) for row in app.main.binding_help()}
        assert rows["view.mesh"] == ("anywhere", "f2, 1*") and rows["app.help"] == ("anywhere", "f1, ?*")
        assert rows["app.copy"] == ("anywhere", "^c") and rows["app.quit"] == ("anywhere", "^q")
        assert rows["chat.new"] == ("chat", "^n") and rows["chat.export"] == ("chat", "^o")
        await pilot.press("escape", "f6")
        assert isinstance(app.screen, PeerScreen)
        await pilot.press("escape")
        assert app.screen is app.main and prompt.value == "1a?r2"


async def test_ctrl_c_copies_the_selection_and_does_not_quit():
    app = MeshApp(ConsoleConfig(), head_url=HEAD, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        hint = app.main.chat_view.query_one("#chat-hint", Static)
        await pilot.press("ctrl+c")  # nothing selected: Textual says how to quit instead
        await pilot.pause()
        assert app.is_running and any("to quit" in n.message for n in app._notifications)
        app.screen.selections = {hint: Selection(None, None)}  # as a mouse drag over the hint would
        await pilot.press("ctrl+c")
        assert app.is_running and app.clipboard.startswith("Ask the mesh anything")
        prompt = app.main.chat_view.prompt
        await pilot.press(*"copy me", "home", "shift+end", "ctrl+c")
        assert prompt.value == "copy me" and app.clipboard == "copy me"  # the prompt copies its own selection
        await pilot.press("ctrl+q")
    assert not app.is_running


async def test_a_new_conversation_cancels_the_answer_and_forgets_the_turns(daemons):
    head = await daemons(0, 30, answer=[f" t{i}" for i in range(10)], hold_after=3)
    app = MeshApp(ConsoleConfig(), head_url=head.url, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "count")
        await wait_until(pilot, lambda: app.state.generations and len(app.state.generations[0].chunk_times) == 3,
                         "three tokens")
        await pilot.press("ctrl+n")
        record = app.state.generations[0]
        await wait_until(pilot, lambda: record.finished, "the cancellation")
        await wait_until(pilot, head.client_left.is_set, "the head to see the stream closed")
        assert record.outcome == "cancelled" and app.state.conversation == []
        view = app.main.chat_view
        await pilot.pause()
        assert not view.query(".prompt") and not view.query(".answer") and view.query("#chat-hint")
        assert "answering" not in text_of(view.status)
        head.head.hold_after = None
        await ask(pilot, "again")
        await wait_until(pilot, lambda: len(app.state.generations) == 2 and app.state.generations[-1].finished,
                         "the new conversation's answer")
        assert head.chat_requests[-1]["messages"] == [{"role": "user", "content": "again"}]
        assert len(view.query(".prompt")) == 1


@pytest.mark.slow  # two real exchanges with the fake head: out of the fast subset
async def test_the_system_prompt_is_shown_and_sent_first(daemons):
    head = await daemons(0, 30)
    app = MeshApp(ConsoleConfig(), head_url=head.url, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        view = app.main.chat_view
        assert not view.system.display
        await pilot.press("ctrl+t")
        assert isinstance(app.screen, SystemPromptScreen)
        await pilot.press(*"You are terse.", "ctrl+s")
        assert app.screen is app.main and app.state.system_prompt == "You are terse."
        assert view.system.display and text_of(view.system) == "system  You are terse."
        await ask(pilot, "hi")
        await wait_until(pilot, lambda: app.state.generations and app.state.generations[-1].finished, "the answer")
        assert head.chat_requests[-1]["messages"] == [{"role": "system", "content": "You are terse."},
                                                      {"role": "user", "content": "hi"}]
        await pilot.press("ctrl+n", "ctrl+t")  # a new conversation keeps it; the dialog starts from it
        area = app.screen.query_one(TextArea)
        assert area.text == "You are terse."
        await pilot.click("#clear")
        await pilot.click("#save")
        assert app.state.system_prompt == "" and not view.system.display


async def test_the_system_prompt_is_kept_in_the_config_for_the_next_start(daemons, tmp_path):
    head = await daemons(0, 30)
    app = saving_app(head.url, tmp_path)
    saved = app.config.path
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5", "ctrl+t")
        await pilot.press(*"Answer in French.", "ctrl+s")
        assert ConsoleConfig.load(saved).system_prompt == "Answer in French."
    again = MeshApp(ConsoleConfig.load(saved), head_url=head.url, poll=False, clock=FrozenClock())
    async with again.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        view = again.main.chat_view
        assert again.state.system_prompt == "Answer in French."
        assert view.system.display and text_of(view.system) == "system  Answer in French."
        await pilot.press("ctrl+t")
        await pilot.click("#clear")
        await pilot.click("#save")
        assert again.state.system_prompt == "" and not view.system.display
    assert ConsoleConfig.load(saved).system_prompt is None


async def test_export_writes_the_conversation_as_markdown_and_json(daemons, tmp_path):
    head = await daemons(0, 30, stats={"failovers": 0})
    app = MeshApp(ConsoleConfig(), head_url=head.url, poll=False, clock=FrozenClock(), export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        app.post_message(NodePolled(head.url, node_status(head.url, 0, 30), session_list([])))
        app.post_message(RoutePolled(head.node.route(refresh=False)))
        await pilot.press("f5", "ctrl+o")  # nothing yet
        await pilot.pause()
        assert list(tmp_path.iterdir()) == [] and "Nothing to export" in list(app._notifications)[-1].message
        app.state.system_prompt = "You are terse."
        await ask(pilot, "hi")
        await wait_until(pilot, lambda: app.state.generations and app.state.generations[-1].finished, "the answer")
        await pilot.press("ctrl+o")
        await pilot.pause()
    (markdown,) = tmp_path.glob("chat-*.md")
    (data,) = tmp_path.glob("chat-*.json")
    assert markdown.stem == data.stem
    notice = list(app._notifications)[-1].message
    assert notice.startswith(f"Exported {markdown.name} and {data.name} to ") and notice.endswith(tmp_path.name)
    record = json.loads(data.read_text())
    assert record["messages"] == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "Hello from the **mesh**."}]
    assert record["head"] == head.url and record["model"]["name"] == MODEL.name
    assert record["route"] == [{"url": head.url, "start_layer": 0, "end_layer": 30, "local": True}]
    assert record["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 256, "seed": None}
    (answer,) = record["answers"]
    assert answer["outcome"] == "done" and answer["tokens"] == 4 and answer["stats"]["completion_tokens"] == 4
    assert answer["usage"]["prompt_tokens"] > 0
    text = markdown.read_text()
    assert text.startswith(f"# Conversation with {MODEL.name}\n")
    assert "Route: local 0-29." in text
    assert "## System\n\nYou are terse." in text and "## You\n\nhi\n" in text
    assert "Hello from the **mesh**.\n\n*4 tokens · 42.0 tok/s*" in text


async def test_a_remap_the_chat_prompt_would_swallow_is_pointed_out():
    config = ConsoleConfig(keys={"chat.export": "ctrl+e", "view.chat": "c", "view.mesh": "f2,m", "session.evict": "x"})
    app = MeshApp(config, head_url=HEAD, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        warnings = [n.message for n in app._notifications if n.severity == "warning"]
        assert warnings == ['In [keys], view.chat = "c"; chat.export = "ctrl+e": the chat\'s prompt takes these keys '
                            'while it has the focus. Add an F-key or a free Ctrl key, e.g. "f5,c".']


async def test_the_command_palette_offers_every_action():
    app = MeshApp(ConsoleConfig(), head_url=HEAD, poll=False, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        titles = {command.title for command in app.get_system_commands(app.screen)}
        assert {"Show Mesh", "Show Sessions", "Show Throughput", "Show Chat", "Evict session", "Cancel answer",
                "Sampling settings", "New chat", "System prompt", "Export chat", "Add peer", "Remove peer",
                "Poll now", "Key bindings", "Theme"} <= titles
        await pilot.press("ctrl+p", *"Show Sessions")
        results = app.screen.query_one(CommandList)
        await wait_until(pilot, lambda: results.option_count > 0, "the palette to search (in the background)")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.query_one(TabbedContent).active == "sessions", "the Sessions view")


class QuickLocalMesh:
    """A local mesh that is up at once, on a fake daemon, and counts how often it is stopped."""

    def __init__(self, head: FakeDaemon) -> None:
        self.head_url = head.url
        self.urls = [head.url]
        self.stopped = 0

    async def start(self, progress) -> None:
        progress("node 0-29", "loading layers 0-29")
        await asyncio.sleep(0.05)
        progress("node 0-29", f"listening on {self.head_url}")

    def stop(self) -> None:
        self.stopped += 1


async def test_a_local_mesh_is_started_shown_and_stopped(daemons):
    head = await daemons(0, 30)
    mesh = QuickLocalMesh(head)
    app = MeshApp(ConsoleConfig(poll_seconds=0.2), local_mesh=mesh, clock=FrozenClock())
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.state.head_url == head.url, "the local head")
        assert app.state.loading["node 0-29"][-1] == f"listening on {head.url}"
        assert not app.main.mesh_view.loading_panel.display
        await wait_until(pilot, lambda: app.state.nodes[head.url].up, "the local head to answer")
        await pilot.press("ctrl+q")
    assert mesh.stopped >= 1


@pytest.mark.slow
async def test_the_console_against_a_real_two_node_mesh(default_model, tmp_path):
    """Real meshd daemons: the shapes, the stream and the eviction as the daemon really serves them."""
    daemons = await asyncio.to_thread(start_mesh, default_model, [("0-14", []), ("15-29", [])], log_dir=tmp_path)
    try:
        head, worker = daemons
        config = ConsoleConfig(poll_seconds=0.3)
        config.chat.max_tokens = 12
        app = MeshApp(config, head_url=head.url)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: sum(n.up for n in app.state.nodes.values()) == 2, "both nodes up",
                             timeout=15)
            await wait_until(pilot, lambda: app.state.route and len(app.state.route.hops) == 2, "a route")
            assert app.state.coverage() == [1] * 30

            await ask(pilot, "Say hello in five words.")
            await wait_until(pilot, lambda: app.state.generations and app.state.generations[-1].finished,
                             "the answer", timeout=120)
            answer = app.state.generations[-1]
            assert answer.outcome == "done" and answer.text and answer.stats.completion_tokens > 0
            prompt_tokens = answer.stats.prompt_tokens
            assert answer.prompt_reuse == (0, prompt_tokens)  # a first turn: nothing held to reuse
            footer = f"reused 0 of {prompt_tokens} prompt tokens"  # shown once the answer's view has finished
            await wait_until(pilot, lambda: footer in text_of(app.main.chat_view.status), "the chat footer")

            # every node keeps an answer's session as a retained prefix until its TTL
            table = app.main.sessions_view.sessions
            key = f"{worker.url} {answer.stats.session_id}"
            # the head tells its peers so in the background as the answer ends: the next poll or two shows it
            await wait_until(pilot, lambda: key in [row.value for row in table.rows]
                             and str(table.get_cell(key, "kind")) == "prefix", "the worker's session, kept")

            # the next turn starts with the first and its answer: the nodes reuse what they kept of it
            await pilot.press(*"And in French?", "enter")
            await wait_until(pilot, lambda: len(app.state.generations) == 2 and app.state.generations[-1].finished,
                             "the second answer", timeout=120)
            second = app.state.generations[-1]
            cached, prompt_tokens = second.prompt_reuse
            assert second.outcome == "done" and 0 < cached < prompt_tokens
            footer = f"reused {cached} of {prompt_tokens} prompt tokens"
            await wait_until(pilot, lambda: footer in text_of(app.main.chat_view.status), "the second footer")

            session_id = second.stats.session_id
            key = f"{worker.url} {session_id}"
            await wait_until(pilot, lambda: key in [row.value for row in table.rows], "the second answer's session")
            await pilot.press("escape", "2")
            table.move_cursor(row=table.get_row_index(key))
            await pilot.press("e", "y")
            await wait_until(pilot, lambda: key not in [row.value for row in table.rows], "the eviction")
            assert session_id not in [s["session_id"] for s in worker.get("/v1/sessions")["sessions"]]
    finally:
        for daemon in daemons:
            await asyncio.to_thread(daemon.stop)


def test_the_console_does_not_import_torch():
    code = "import meshtui.app, sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
