"""A titled, bordered part of a view."""

from __future__ import annotations

from textual.containers import Vertical


class Section(Vertical):
    """A bordered group with a title on its border; its look is the ``Section`` rule in meshtui.tcss."""

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = title
