"""The Throughput view: tokens/s of the latest answer as it streamed, per node, and past answers."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Label, Sparkline, Static

from meshtui.state import GenerationRecord, MeshState, NodeState
from meshtui.widgets.formatting import format_ms, format_rate, plural, short_url
from meshtui.widgets.keyed_table import KeyedTable
from meshtui.widgets.section import Section

GENERATION_COLUMNS = [("number", "#"), ("prompt", "prompt"), ("tokens", "tokens"), ("rate", "tok/s"),
                      ("prefill", "prefill"), ("first", "first token"), ("misses", "misses"),
                      ("reprefills", "re-prefills"), ("outcome", "outcome")]
PROMPT_WIDTH = 24
OUTCOME_STYLES = {"streaming": "bold cyan", "done": "green", "cancelled": "yellow", "failed": "bold red"}


def generation_stats(record: GenerationRecord) -> Text:
    """One line of what an answer cost, as the chat view and this view both show it."""
    stats = record.stats
    text = Text()
    text.append(plural(record.tokens, "token"), style="bold")
    text.append(f" · {format_rate(record.tokens_per_second)}")
    if stats is not None:
        text.append(f" · prefill {format_ms(stats.prefill_ms)}")
        text.append(f" · first token {format_ms(stats.first_token_ms)}")
        misses, reprefills = stats.cache_misses, stats.reprefills
        text.append(f" · {plural(misses, 'cache miss', 'cache misses')} · {plural(reprefills, 're-prefill')}",
                    style="yellow" if misses or reprefills else "")
        # a hop that failed, or a far faster route, moved the answer mid-way: rare, so shown only when it happened
        moves = [plural(count, what) for count, what in ((stats.failovers, "failover"), (stats.reroutes, "reroute"))
                 if count]
        if moves:
            text.append(" · " + " · ".join(moves), style="bold yellow")
        if stats.drafted_tokens:  # speculative decoding: how much of what the head drafted the tail kept
            accepted = stats.accepted_tokens / stats.drafted_tokens
            text.append(f" · {accepted:.0%} of {plural(stats.drafted_tokens, 'drafted token')} accepted",
                        style="cyan")
    return text


class NodeRate(Horizontal):
    """One node's tokens/s over the last polls, from the growth of its ``tokens_served``."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self._graph = Sparkline([], classes="node-graph")
        self._now = Label("", classes="node-now")

    def compose(self) -> ComposeResult:
        yield Label(short_url(self.url), classes="node-label")
        yield self._graph
        yield self._now

    def show(self, node: NodeState) -> None:
        if self._graph.data is not node.tokens_per_second:
            self._graph.data = node.tokens_per_second  # NodeState hands out a new list per sample
        now = Text()
        if not node.up:
            now.append("down", style="red")
        elif node.tokens_per_second:
            now.append(f"{node.tokens_per_second[-1]:.1f} tok/s", style="bold")
            now.append(f" · {node.steps_per_second[-1]:.1f} steps/s", style="dim")
        else:
            now.append("measuring…", style="dim")
        self._now.update(now)


class ThroughputView(VerticalScroll):
    """The latest answer's tokens/s per chunk, each node's tokens/s per poll, and every answer so far."""

    def __init__(self, state: MeshState, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.state = state
        self.latest_title = Static(Text("no answer yet: ask the mesh something in the Chat view", style="dim"),
                                   id="generation-title")
        self.latest_graph = Sparkline([], id="generation-graph")
        self.latest_stats = Static(id="generation-stats")
        self.node_rates = Section("tokens/s each node ran", id="node-rates")
        self.generations = KeyedTable(GENERATION_COLUMNS, id="generations")
        self._node_rows: dict[str, NodeRate] = {}

    def compose(self) -> ComposeResult:
        with Section("latest answer · tokens/s as it streamed", id="last-generation"):
            yield self.latest_title
            yield self.latest_graph
            yield self.latest_stats
        yield self.node_rates
        with Section("answers", id="generations-box"):
            yield self.generations

    def show_nodes(self) -> None:
        for url in [url for url in self._node_rows if url not in self.state.nodes]:
            self._node_rows.pop(url).remove()
        for url, node in self.state.nodes.items():
            row = self._node_rows.get(url)
            if row is None:
                row = self._node_rows[url] = NodeRate(url)
                self.node_rates.mount(row)
            row.show(node)

    def show_generation(self, record: GenerationRecord) -> None:
        """Draw ``record`` as the latest answer and update its row in the table."""
        title = Text()
        title.append(f"#{record.number} ", style="bold")
        title.append(record.outcome, style=OUTCOME_STYLES[record.outcome])
        title.append(f" · {_excerpt(record.prompt, 60)}", style="dim")
        self.latest_title.update(title)
        self.latest_graph.data = record.rates()
        self.latest_stats.update(generation_stats(record))
        self.generations.show({str(r.number): _generation_row(r) for r in self.state.generations})


def _generation_row(record: GenerationRecord) -> list:
    stats = record.stats
    return [str(record.number), _excerpt(record.prompt, PROMPT_WIDTH), str(record.tokens),
            format_rate(record.tokens_per_second, unit=""), format_ms(stats and stats.prefill_ms),
            format_ms(stats and stats.first_token_ms), str(stats.cache_misses) if stats else "—",
            str(stats.reprefills) if stats else "—", Text(record.outcome, style=OUTCOME_STYLES[record.outcome])]


def _excerpt(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
