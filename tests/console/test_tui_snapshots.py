"""SVG snapshots of every console view.

As in memray's live TUI tests: polling is off, the clock is frozen, and polls arrive as the very
messages the poller posts, so the real handlers draw every screen. A chat is answered by a scripted
head in the console's own loop (``tests.support.console_messages.AnsweringConsole``), which moves the
frozen clock before each chunk and posts the chunks as the messages the console's HTTP worker posts.
Route events show the local wall clock, so the time zone is pinned to UTC. Update the baselines with
``pytest tests/console/test_tui_snapshots.py --snapshot-update`` and look at the SVGs.

Marked ``slow``, as golden renders (1-5 s each, 30 s in all on a 2-core host): the fast subset keeps the pilot's
tests of the same views' behaviour and stays under 3 minutes.
"""

from __future__ import annotations

import time

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Markdown, TextArea

from daemon.api import RouteInfo
from meshtui.app import MeshApp
from meshtui.client import UNAUTHORIZED
from meshtui.config import ConsoleConfig
from meshtui.messages import NodePolled, RoutePolled
from tests.support.console_messages import AnsweringConsole
from tests.support.tui_data import (
    HEAD,
    HEAD_SESSIONS,
    NOW,
    REPLICA,
    WORKER,
    WORKER_SESSIONS,
    FrozenClock,
    ScriptedHead,
    StartingMesh,
    failover_route,
    node_status,
    session_list,
    two_node_route,
)

pytestmark = pytest.mark.slow

SIZE = (100, 32)
UNEVEN_STEPS = (0.08, 0.09, 0.1, 0.12, 0.2, 0.1, 0.09, 0.08, 0.08, 0.11)  # seconds between chunks
ANSWER = ("A **KV cache** keeps each layer's keys and values, so a decode step sends only the newest "
          "token through the mesh:\n\n- node 1 runs layers `0-14`\n- node 2 runs layers `15-29`\n\n"
          "Each hop keeps its own")
FINAL_STATS = {"session_id": "5d1e0c9a7b3f2e4d6c8a0b1c", "prompt_tokens": 31, "completion_tokens": 42,
               "prefills": 1, "reprefills": 1, "cache_misses": 1, "prefill_ms": 291.4, "first_token_ms": 318.0,
               "decode_tokens_per_second": 9.98, "finish_reason": "stop"}


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """Route events show local wall-clock times: the same on every machine only in one time zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def console(clock: FrozenClock | None = None, *, head: ScriptedHead | None = None, **kwargs) -> MeshApp:
    """The console on a frozen clock; with ``head``, one whose chat that head answers."""
    kwargs.setdefault("head_url", HEAD)
    clock = clock or FrozenClock()
    if head is not None:
        return AnsweringConsole(ConsoleConfig(), poll=False, clock=clock, head=head, **kwargs)
    return MeshApp(ConsoleConfig(), poll=False, clock=clock, **kwargs)


def answer_tokens(text: str = ANSWER) -> list[str]:
    return [w if i == 0 else " " + w for i, w in enumerate(text.split(" "))]


def scripted(clock: FrozenClock, text: str, **kwargs) -> ScriptedHead:
    """A head that answers ``text`` word by word, moving ``clock`` before each chunk."""
    return ScriptedHead(answer_tokens(text), clock=clock, **kwargs)


def steady(app: MeshApp) -> None:
    """No blinking cursors: a snapshot must not depend on when it was taken."""
    for field in [*app.screen.query(Input), *app.screen.query(TextArea)]:
        field.cursor_blink = False


async def ready(pilot: Pilot) -> None:
    """Unlike run_test, the snapshot autopilot starts before the first screen has composed: wait for it."""
    for _ in range(200):
        if pilot.app.screen.is_mounted:
            return
        await pilot.pause(0.01)
    raise AssertionError("the main screen never mounted")


async def settle(pilot: Pilot, until=lambda: True) -> None:
    for _ in range(100):
        await pilot.pause()
        if until():
            break
    steady(pilot.app)
    await pilot.pause()


def answered(app: MeshApp, count: int):
    """A condition for :func:`settle`: ``count`` answers asked for, and the last one finished."""
    return lambda: len(app.state.generations) == count and app.state.generations[-1].finished


def post_healthy_mesh(app: MeshApp) -> None:
    app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 15, peers=[WORKER], steps_served=1204, sessions=2),
                                session_list(HEAD_SESSIONS, hits=96, misses=1)))
    app.post_message(NodePolled(WORKER, node_status(WORKER, 15, 30, steps_served=1187, active_steps=1, sessions=1),
                                session_list(WORKER_SESSIONS, hits=95, misses=1, evictions={"ttl": 2})))
    app.post_message(RoutePolled(two_node_route()))


def test_mesh_healthy(snap_compare):
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        post_healthy_mesh(app)
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_mesh_small_terminal(snap_compare):
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        post_healthy_mesh(app)
        await settle(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_mesh_loading_local_daemons(snap_compare):
    mesh = StartingMesh([
        ("node 0-14", "fetching SmolLM2-135M-Instruct from the package index"),
        ("node 0-14", "converting the GGUF file to safetensors (once)"),
        ("node 0-14", "loading layers 0-14 and the embeddings"),
        ("node 15-29", "loading layers 15-29, final norm and LM head"),
    ])
    app = console(head_url=None, local_mesh=mesh)

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        await settle(pilot, until=lambda: len(app.state.loading) == 2)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_mesh_node_down(snap_compare):
    clock = FrozenClock()
    app = console(clock)

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        post_healthy_mesh(app)
        await settle(pilot)
        clock.advance(7)
        app.post_message(NodePolled(WORKER, None, None, "connection refused"))
        app.post_message(RoutePolled(RouteInfo(error="no node hosts layers 15-29")))
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_mesh_failover(snap_compare):
    """The replica on :7072 died mid-answer and :7071 took over: the route's latency split, its counts and events."""
    clock = FrozenClock()
    app = console(clock)

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 15, peers=[WORKER, REPLICA], steps_served=2410,
                                                      active_generations=1, sessions=1),
                                    session_list(HEAD_SESSIONS[:1])))
        app.post_message(NodePolled(WORKER, node_status(WORKER, 15, 30, steps_served=1306, active_steps=1,
                                                        sessions=1), session_list(WORKER_SESSIONS)))
        app.post_message(NodePolled(REPLICA, node_status(REPLICA, 15, 30, steps_served=1104), session_list([])))
        await settle(pilot)
        clock.advance(29)
        app.post_message(NodePolled(REPLICA, None, None, "connection refused"))
        app.post_message(RoutePolled(failover_route()))
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_mesh_draining_node(snap_compare):
    """A rolling restart: :7071 drains (finishing its step, taking nothing new), the replica carries the route."""
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 15, peers=[WORKER, REPLICA], steps_served=1204),
                                    session_list([])))
        app.post_message(NodePolled(WORKER, node_status(WORKER, 15, 30, steps_served=1187, active_steps=1,
                                                        draining=True), session_list(WORKER_SESSIONS)))
        app.post_message(NodePolled(REPLICA, node_status(REPLICA, 15, 30, steps_served=96), session_list([])))
        route = two_node_route()
        route.hops[1].url = REPLICA
        app.post_message(RoutePolled(route))
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_mesh_token_refused(snap_compare):
    """The worker was started with another mesh token: it refuses the console (and the head) with a 401."""
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 15, peers=[WORKER]), session_list([])))
        app.post_message(NodePolled(WORKER, None, None, UNAUTHORIZED, 401))
        app.post_message(RoutePolled(RouteInfo(error="no live node serves layers 15-29 of 0-29; start a node "
                                                     "with --layers covering them or add it with --peer")))
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_mesh_coverage_gap_and_overlap(snap_compare):
    third = "http://10.0.0.3:7071"
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 10, peers=[WORKER, third]), session_list([])))
        app.post_message(NodePolled(WORKER, node_status(WORKER, 8, 20), session_list([])))
        app.post_message(NodePolled(third, node_status(third, 22, 30), session_list([])))
        app.post_message(RoutePolled(RouteInfo(error="no node hosts layers 20-21")))
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_sessions_ttl_countdown(snap_compare):
    clock = FrozenClock()
    app = console(clock)

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        post_healthy_mesh(app)
        await pilot.press("2")
        clock.advance(10)  # ten local seconds later, with no poll in between
        app.tick()
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_sessions_evict_confirmation(snap_compare):
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        post_healthy_mesh(app)
        await pilot.press("2", "down", "e")
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_throughput_with_data(snap_compare):
    clock = FrozenClock()
    app = console(clock, head=scripted(clock, ANSWER, stats=FINAL_STATS, steps=UNEVEN_STEPS))
    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        for second, (head_tokens, worker_tokens) in enumerate([(0, 0), (40, 40), (52, 52), (61, 61), (70, 70),
                                                                (80, 80), (88, 88), (100, 100), (140, 140)]):
            time = NOW + second
            app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 15, peers=[WORKER], time=time,
                                                          tokens_served=head_tokens, steps_served=head_tokens),
                                        session_list(HEAD_SESSIONS, time=time)))
            app.post_message(NodePolled(WORKER, node_status(WORKER, 15, 30, time=time, tokens_served=worker_tokens,
                                                            steps_served=worker_tokens // 2),
                                        session_list(WORKER_SESSIONS, time=time)))
        await pilot.press("4")
        await pilot.press(*"why a kv cache")
        await pilot.press("enter")
        await settle(pilot, until=lambda: bool(app.state.generations) and app.state.generations[-1].finished)
        await pilot.press("escape", "3")  # Esc leaves the prompt, so the next key switches views
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat_mid_stream(snap_compare):
    clock = FrozenClock()
    app = console(clock, head=scripted(clock, ANSWER, steps=UNEVEN_STEPS, hold_after=len(answer_tokens())))

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        post_healthy_mesh(app)
        await pilot.press("4")
        await pilot.press(*"Explain the KV cache in one paragraph")
        await pilot.press("enter")
        await settle(pilot, until=lambda: app.main.chat_view.query(Markdown) and
                     app.main.chat_view.query(Markdown).last().source == ANSWER)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat_answered(snap_compare):
    clock = FrozenClock()
    app = console(clock, head=scripted(clock, "Layers **0-14** run here; **15-29** on the worker.", stats=FINAL_STATS))

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        await pilot.press("4")
        await pilot.press(*"Where do the layers run?")
        await pilot.press("enter")
        await settle(pilot, until=lambda: bool(app.state.generations) and app.state.generations[-1].finished)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat_follow_up_reuses_the_prefix(snap_compare):
    """The second turn starts with the first and its answer, which the nodes kept: the footer says so."""
    clock = FrozenClock()
    app = console(clock, head=scripted(clock, "Layers **0-14** run here; **15-29** on the worker."))

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        await pilot.press("4")
        for turn, prompt in enumerate(["Where do the layers run?", "And the KV cache?"], start=1):
            await pilot.press(*prompt, "enter")
            await settle(pilot, until=answered(app, turn))
            app.head.answer = answer_tokens("Each node keeps the keys and values of its own layers.")

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat_sampling_settings(snap_compare):
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        await pilot.press("4", "ctrl+s")
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat_sampling_past_the_heads_cap(snap_compare):
    """The head reports its cap in /v1/status: the dialog says it, and refuses more."""
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        app.post_message(NodePolled(HEAD, node_status(HEAD, 0, 30, max_tokens_cap=2048, context_length=2048),
                                    session_list([])))
        await pilot.press("f5", "ctrl+s")
        await settle(pilot)
        max_tokens = app.screen.query_one("#max_tokens", Input)
        max_tokens.value = "8000"
        max_tokens.focus()
        await pilot.press("enter")  # saves: no mouse left hovering on a button
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat_system_prompt_dialog(snap_compare):
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        await pilot.press("f5", "ctrl+t")
        area = app.screen.query_one(TextArea)
        area.text = "You are a terse assistant for mesh operators.\nAnswer in one paragraph."  # typing it is slow
        area.move_cursor(area.document.end)
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat_exported(snap_compare, tmp_path, monkeypatch):
    """A conversation under a system prompt, exported: the notification says where the two files went."""
    monkeypatch.setenv("HOME", str(tmp_path))
    clock = FrozenClock()
    app = console(clock, head=scripted(clock, "Layers **0-14** run here; **15-29** on the worker.", stats=FINAL_STATS),
                  export_dir=tmp_path / ".local/share/meshnet/conversations")

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        post_healthy_mesh(app)
        await pilot.press("f5", "ctrl+t")
        app.screen.query_one(TextArea).text = "Answer in one sentence."
        await pilot.press("ctrl+s")
        await pilot.press(*"Where do the layers run?", "enter")
        await settle(pilot, until=answered(app, 1))
        await pilot.press("ctrl+o")
        await settle(pilot, until=lambda: bool(app._notifications))

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_add_peer_dialog(snap_compare):
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        await pilot.press("a", *"10.0.0.7:7071")
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare):
    app = console()

    async def run_before(pilot: Pilot) -> None:
        await ready(pilot)
        await pilot.press("f1")
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
