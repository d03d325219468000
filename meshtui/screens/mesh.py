"""The Mesh view: every node, their layers against the model's, and the head's route with its latency and changes."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from daemon.api import RouteHopInfo, RouteInfo
from meshtui.state import MeshState, NodeState, RouteChange, layer_runs
from meshtui.widgets.formatting import format_bytes, format_clock, format_duration, plural, short_node, short_url
from meshtui.widgets.keyed_table import KeyedTable
from meshtui.widgets.layer_map import LayerHop, LayerMap, LayerRow
from meshtui.widgets.section import Section

# "runs in": the node's compute dtype and device; "peak": its process's peak resident memory (VmHWM)
NODE_COLUMNS = [("node", "node"), ("state", "state"), ("layers", "layers"), ("roles", "roles"), ("cache", "cache"),
                ("runs", "runs in"), ("peak", "peak"), ("load", "load"), ("served", "steps served")]
DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# "runs" starts at the hop's start layer; latency is the head's moving average of a decode step on the hop,
# end to end, with the share that is not the node's compute (wire, HTTP, queueing) as "net"
ROUTE_COLUMNS = [("hop", "hop"), ("node", "node"), ("hosts", "hosts"), ("runs", "runs"), ("cache", "cache"),
                 ("latency", "latency")]
EVENT_STYLES = {"failover": "bold yellow", "reroute": "bold cyan", "no_route": "bold red", "joined": "bold green",
                "left": "bold magenta", "down": "bold red", "forgotten": "dim"}


class LoadingPanel(Static):
    """The local mesh's start-up: the latest lines each node printed while loading."""

    def show(self, state: MeshState) -> None:
        self.display = state.starting or state.loading_error is not None
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        for label, lines in state.loading.items():
            earlier = [Text(line, style="dim") for line in lines[:-1]]
            grid.add_row(label, Text("\n").join([*earlier, Text(lines[-1])]))
        if state.loading_error:
            grid.add_row(Text("failed", style="bold red"), Text(state.loading_error, style="red"))
        elif not state.loading:
            grid.add_row("", Text("starting local daemons…", style="dim"))
        self.update(grid)


class MeshView(VerticalScroll):
    """Nodes (up/down, model, roles, cache, load), a layer map showing coverage, and the route."""

    def __init__(self, state: MeshState, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.state = state
        self.summary = Static(id="mesh-summary")
        self.loading_panel = LoadingPanel(id="loading")
        self.loading_panel.border_title = "starting the local mesh"
        self.loading_panel.display = False
        self.nodes = KeyedTable(NODE_COLUMNS, id="nodes")
        self.node_errors = Static(id="node-errors")
        self.layers_section = Section("layers", id="layers-box")
        self.layer_map = LayerMap(id="layer-map")
        self.route_section = Section("route", id="route-box")
        self.hops = KeyedTable(ROUTE_COLUMNS, id="route")
        self.route_error = Static(id="route-error")
        self.route_events = Static(id="route-events")

    def compose(self) -> ComposeResult:
        yield self.summary
        yield self.loading_panel
        with Section("nodes", id="nodes-box"):
            yield self.nodes
            yield self.node_errors
        with self.layers_section:
            yield self.layer_map
        with self.route_section:
            yield self.hops
            yield self.route_error
            yield self.route_events

    def show_loading(self) -> None:
        self.loading_panel.show(self.state)

    def show_nodes(self, now: float) -> None:
        state = self.state
        self.nodes.show({url: self._node_row(node, now) for url, node in state.nodes.items()})
        errors = [_down_line(node, now) for node in state.nodes.values() if node.error]
        self.node_errors.display = bool(errors)
        self.node_errors.update(Text("\n".join(errors), style="red"))
        self.summary.update(self._summary())
        self._show_layers()

    def _node_row(self, node: NodeState, now: float) -> list:
        marker = "◆ " if node.url == self.state.head_url else "  "
        label = Text(marker + short_url(node.url), style="bold" if marker.strip() else "")
        status = node.status
        if node.draining:
            state = Text("◐ draining", style="bold yellow")
        elif node.up:
            state = Text("● up", style="green")
        elif node.unauthorized:
            state = Text("✕ 401", style="bold red")
        elif node.polled:
            state = Text("✕ down", style="bold red")
        else:
            state = Text("… polling", style="dim")
        if status is None:
            return [label, state, "", "", "", "", "", "", ""]
        cache = ("on" if status.kv_cache_enabled else "off") if status.supports_kv_cache else "n/a"
        load = _load(status) if node.up else ""
        runs = " ".join(w for w in (DTYPE_SHORT.get(status.dtype, status.dtype), status.quantize,
                                    status.device) if w)
        peak = status.memory.peak_rss_bytes
        return [label, state, status.layers, " ".join(status.roles),
                Text(cache, style="" if cache == "on" else "yellow"), runs, format_bytes(peak) if peak else "",
                Text(load or "idle", style="" if load else "dim"), f"{status.steps_served:,}"]

    def _summary(self) -> Text:
        state = self.state
        if state.starting:
            return Text("starting a local mesh…", style="dim")
        if state.head_url is None:
            return Text("no head node: give meshtui a --head URL or peers in its config", style="yellow")
        model = state.model
        up = sum(n.up for n in state.nodes.values())
        summary = Text()
        head = state.nodes.get(state.head_url)
        if model is None and head is not None and head.error:
            summary.append("the head refuses the console's mesh token" if head.unauthorized else
                           "the head does not answer", style="bold red")
        elif model is None:
            summary.append("waiting for the head to answer…", style="dim")
        else:
            summary.append(model.name, style="bold")
            summary.append(f" · {model.model_type} · {model.num_layers} layers · hidden {model.hidden_size}")
        summary.append(" · ")
        summary.append(f"{up}/{len(state.nodes)} nodes up", style="green" if up == len(state.nodes) else "bold red")
        if state.draining:
            summary.append(f" · {state.draining} draining", style="bold yellow")
        return summary

    def _show_layers(self) -> None:
        state = self.state
        model = state.model
        rows = [LayerRow(short_url(n.url), n.status.start, n.status.end, n.up, n.draining)
                for n in state.nodes.values() if n.status is not None]
        route = state.current_route
        hops = [LayerHop(h.start_layer, h.end_layer) for h in route.hops] if route else []
        self.layer_map.show(model.num_layers if model else 0, rows, hops)
        if model is None:
            self.layers_section.border_subtitle = ""
            return
        counts = state.coverage()
        gaps = layer_runs(counts, lambda c: c == 0)
        overlaps = layer_runs(counts, lambda c: c > 1)
        parts = [f"gap at {_runs(gaps)}" if gaps else f"all {len(counts)} layers covered"]
        if overlaps:
            parts.append(f"overlap at {_runs(overlaps)}")
        self.layers_section.border_subtitle = " · ".join(parts)
        self.layers_section.set_class(bool(gaps), "-gap")

    def show_route(self) -> None:
        state = self.state
        route = state.current_route
        rows = {}
        for i, hop in enumerate(route.hops if route else []):
            node = state.nodes.get(hop.url)
            hosts = node.status.layers if node is not None and node.status is not None else "?"
            rows[str(i)] = [str(i + 1), short_url(hop.url) + (" (local)" if hop.local else ""), hosts,
                            f"{hop.start_layer}-{hop.end_layer - 1}", "on" if hop.kv_cache else "off",
                            _hop_latency(hop)]
        self.hops.show(rows)
        self.hops.display = bool(rows)
        if state.route_error:
            self.route_error.update(Text(f"the head's route is unknown: {state.route_error}", style="bold red"))
        elif route is not None and route.error:
            self.route_error.update(Text(f"no route: {route.error}", style="bold red"))
        elif not rows:
            self.route_error.update(Text("no route yet", style="dim"))
        self.route_error.display = not rows or bool(route and route.error)
        events = state.recent_route_events()
        self.route_events.update(Text("\n").join(_event_line(e, state.head_url) for e in events))
        self.route_events.display = bool(events)
        self.route_section.border_subtitle = _route_subtitle(route, len(rows))
        self._show_layers()


def _load(status) -> str:
    """What a node is doing right now: generations it runs as head, forward steps it runs as a hop."""
    parts = []
    if status.active_generations:
        parts.append(f"{status.active_generations} gen")
    if status.active_steps:
        parts.append(f"{status.active_steps} step{'s' if status.active_steps != 1 else ''}")
    return " · ".join(parts)


def _down_line(node: NodeState, now: float) -> str:
    if node.last_seen is not None:
        return f"{short_url(node.url)}: {node.error} · last seen {format_duration(now - node.last_seen)} ago"
    if node.unauthorized:  # it answers, only not to us
        return f"{short_url(node.url)}: {node.error}"
    return f"{short_url(node.url)}: {node.error} · never answered"


def _hop_latency(hop: RouteHopInfo) -> str:
    """``31.2 ms (3.1 net)``: a decode step on the hop, and of it what is not the node's compute."""
    if hop.latency_ms is None:
        return "—"
    if hop.local or hop.overhead_ms is None:  # a local hop crosses no wire: all of it is compute
        return f"{hop.latency_ms:.1f} ms"
    return f"{hop.latency_ms:.1f} ms ({hop.overhead_ms:.1f} net)"


def _route_subtitle(route: RouteInfo | None, hops: int) -> str:
    parts = [plural(hops, "hop")] if hops else []
    if route is not None:
        parts += [plural(count, what) for count, what in ((route.failovers, "failover"), (route.reroutes, "reroute"))
                  if count]
    return " · ".join(parts)


def _event_line(event: RouteChange, head_url: str | None) -> Text:
    """``13:02:11 failover  :7072 unreachable → :7071 at position 45``, newest first in the route section.

    The position counts the prompt's tokens and the answer's so far: where the sequence was when it happened."""
    line = Text()
    line.append(format_clock(event.time), style="dim")
    line.append(" ")
    line.append(f"{event.kind.replace('_', ' '):<10}", style=EVENT_STYLES.get(event.kind, "bold"))
    if event.failed:
        line.append(short_node(event.failed, head_url), style="bold")
        line.append(" failed; " if event.kind == "no_route" else " ")
    if event.node:
        line.append(short_node(event.node, head_url), style="bold")
        line.append(" ")
    line.append(event.reason)
    if event.route:
        remote = [short_node(url, head_url) for url in event.route if url != "local"]
        line.append(" → " + (" ".join(remote) if remote else "local"))
    if event.position is not None:
        line.append(f" at position {event.position}", style="dim")
    return line


def _runs(runs: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
