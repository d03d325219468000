"""A DataTable kept in step with a mapping of rows, touching only what changed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import RenderableType
from textual.widgets import DataTable


class KeyedTable(DataTable):
    """Rows are keyed; :meth:`show` adds, removes and updates single cells, so the cursor stays put.

    A live table rebuilt on every poll flickers and loses the operator's selection; this one never
    clears itself.
    """

    def __init__(self, columns: Sequence[tuple[str, str]], **kwargs) -> None:
        super().__init__(cursor_type="row", **kwargs)
        self._column_keys = [key for key, _ in columns]
        for key, label in columns:
            self.add_column(label, key=key)
        self._shown: dict[str, tuple[RenderableType, ...]] = {}

    def show(self, rows: Mapping[str, Sequence[RenderableType]]) -> None:
        """Make the table hold exactly ``rows`` (row key -> one value per column)."""
        with self.app.batch_update():
            for key in [key for key in self._shown if key not in rows]:
                self.remove_row(key)
                del self._shown[key]
            for key, values in rows.items():
                values = tuple(values)
                shown = self._shown.get(key)
                if shown is None:
                    self.add_row(*values, key=key)
                else:
                    for column, new, old in zip(self._column_keys, values, shown):
                        if new != old:
                            self.update_cell(key, column, new, update_width=True)
                self._shown[key] = values

    @property
    def selected_key(self) -> str | None:
        """The row key under the cursor, if the table has rows."""
        if not self._shown or self.cursor_row < 0 or self.cursor_row >= self.row_count:
            return None
        return self.coordinate_to_cell_key((self.cursor_row, 0)).row_key.value
