"""Each node's layer range drawn against the model's layer axis, with the route and the coverage."""

from __future__ import annotations

from dataclasses import dataclass

from rich.style import Style
from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from meshtui.state import layer_coverage


@dataclass(frozen=True)
class LayerRow:
    """One node: a label and the half-open layer range it hosts."""

    label: str
    start: int
    end: int
    up: bool = True
    draining: bool = False  # up, but taking no new work: it does not count for coverage


@dataclass(frozen=True)
class LayerHop:
    """One hop of the route: the layers it runs (half-open)."""

    start: int
    end: int


class LayerMap(Widget):
    """A row of cells per node over layers ``0..N-1``, the route's hops, and a coverage row.

    Coverage counts only nodes that are up and not draining: a layer no serving node hosts is a gap,
    drawn in red. The axis spans the widget's width: wide terminals give each layer several cells,
    narrow ones fold several layers into one cell, where a gap anywhere in the cell still shows.
    """

    COMPONENT_CLASSES = {
        "layer-map--label", "layer-map--axis", "layer-map--hosted", "layer-map--down", "layer-map--draining",
        "layer-map--idle",
        "layer-map--hop-odd", "layer-map--hop-even", "layer-map--covered", "layer-map--overlap",
        "layer-map--gap",
    }

    DEFAULT_CSS = """
    LayerMap { height: auto; }
    LayerMap > .layer-map--label { color: $text-muted; }
    LayerMap > .layer-map--axis { color: $text-muted; }
    LayerMap > .layer-map--hosted { color: $primary; }
    LayerMap > .layer-map--down { color: $error 70%; }
    LayerMap > .layer-map--draining { color: $warning 60%; }
    LayerMap > .layer-map--idle { color: $text-disabled; }
    LayerMap > .layer-map--hop-odd { color: $accent; text-style: bold; }
    LayerMap > .layer-map--hop-even { color: $text-primary; text-style: bold; }
    LayerMap > .layer-map--covered { color: $success; }
    LayerMap > .layer-map--overlap { color: $warning; }
    LayerMap > .layer-map--gap { color: $error; text-style: bold; }
    """

    MAX_LABEL = 22

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._num_layers = 0
        self._rows: tuple[LayerRow, ...] = ()
        self._hops: tuple[LayerHop, ...] = ()

    def show(self, num_layers: int, rows: list[LayerRow], hops: list[LayerHop]) -> None:
        new = (num_layers, tuple(rows), tuple(hops))
        if new != (self._num_layers, self._rows, self._hops):
            self._num_layers, self._rows, self._hops = new
            self.refresh(layout=True)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if not self._num_layers:
            return 1
        return 3 + len(self._rows) + (1 if self._hops else 0)

    def render(self) -> Text:
        if not self._num_layers:
            return Text("no layers to draw yet: no node has answered", style=self._style("label"))
        label_width = min(self.MAX_LABEL, max([len(r.label) for r in self._rows] + [8]) + 1)
        columns = self._columns(max(1, self.size.width - label_width))
        lines = [self._axis(label_width, columns)]
        lines += [self._node_line(row, label_width, columns) for row in self._rows]
        if self._hops:
            lines.append(self._route_line(label_width, columns))
        lines.append(self._coverage_line(label_width, columns))
        lines.append(self._legend())
        return Text("\n").join(lines)

    def _style(self, part: str) -> Style:
        return self.get_component_rich_style(f"layer-map--{part}")

    def _columns(self, width: int) -> list[range]:
        """The layers each drawn cell stands for: several cells per layer, or several layers per cell."""
        n = self._num_layers
        return [range(c * n // width, max((c + 1) * n // width, c * n // width + 1)) for c in range(width)]

    def _label(self, text: str, width: int) -> Text:
        if len(text) >= width:
            text = text[: width - 2] + "…"
        return Text(text.ljust(width), style=self._style("label"))

    def _axis(self, label_width: int, columns: list[range]) -> Text:
        first_column = {}
        for i, layers in enumerate(columns):
            for layer in layers:
                first_column.setdefault(layer, i)
        cells_per_layer = len(columns) / self._num_layers
        # a tick every 1, 5, 10... layers, as dense as leaves room for the numbers
        step = next(s for s in (1, 5, 10, 20, 50, 100, 250, 500, 1000) if s * cells_per_layer >= 4 or s == 1000)
        last = self._num_layers - 1
        ticks = [layer for layer in range(0, last, step)
                 if first_column[layer] + len(str(layer)) < first_column[last] - 1]
        axis = [" "] * len(columns)
        for layer in [*ticks, last]:
            position = min(first_column[layer], len(columns) - len(str(layer)))
            axis[position:position + len(str(layer))] = str(layer)
        return self._label("layer", label_width) + Text("".join(axis)[: len(columns)], style=self._style("axis"))

    def _node_line(self, row: LayerRow, label_width: int, columns: list[range]) -> Text:
        line = self._label(row.label, label_width)
        serving = row.up and not row.draining
        hosted_style = self._style("hosted" if serving else "draining" if row.up else "down")
        for layers in columns:
            hosted = any(row.start <= layer < row.end for layer in layers)
            if hosted:
                line.append("█" if serving else "▒", hosted_style)
            else:
                line.append("·", self._style("idle"))
        return line

    def _route_line(self, label_width: int, columns: list[range]) -> Text:
        line = self._label("route", label_width)
        previous = None
        for layers in columns:
            hop = next((i for i, h in enumerate(self._hops) if h.start <= layers.start < h.end), None)
            if hop is None:
                line.append(" ")
            else:
                style = self._style("hop-odd" if hop % 2 == 0 else "hop-even")
                line.append(str((hop + 1) % 10) if hop != previous else "━", style)
            previous = hop
        return line

    def _coverage_line(self, label_width: int, columns: list[range]) -> Text:
        counts = layer_coverage(self._num_layers, [(r.start, r.end) for r in self._rows if r.up and not r.draining])
        line = self._label("coverage", label_width)
        for layers in columns:
            cell = [counts[layer] for layer in layers]
            if min(cell) == 0:
                line.append("✕", self._style("gap"))
            elif max(cell) > 1:
                line.append("▓", self._style("overlap"))
            else:
                line.append("█", self._style("covered"))
        return line

    def _legend(self) -> Text:
        draining = [("▒", self._style("draining")), (" draining  ", self._style("label"))] \
            if any(r.draining for r in self._rows) else []
        return Text.assemble(
            ("█", self._style("covered")), (" covered  ", self._style("label")),
            ("▓", self._style("overlap")), (" overlap  ", self._style("label")),
            ("✕", self._style("gap")), (" gap  ", self._style("label")),
            ("▒", self._style("down")), (" down node  ", self._style("label")),
            *draining,
            ("1━", self._style("hop-odd")), (" route hop", self._style("label")),
        )
