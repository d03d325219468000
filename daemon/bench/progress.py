"""Progress lines on stderr while the benchmark runs."""

from __future__ import annotations

import sys
import time


def say(message: str) -> None:
    """One ``[bench]`` line on stderr."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


class Progress:
    """One line on stderr that counts tokens: redrawn in place on a terminal, every quarter otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.started = time.perf_counter()
        self._tty = sys.stderr.isatty()
        self._shown = 0  # tokens when last drawn (terminal) or quarters reported (log)

    def step(self) -> None:
        """One more token (a streamed chunk of text counts as one: close enough for a progress line)."""
        self.done += 1
        elapsed = time.perf_counter() - self.started
        if self._tty:
            if self.done == self.total or self.done - self._shown >= 4:
                self._shown = self.done
                print(f"\r[bench] {self.label}: {self.done}/{self.total} tokens, {elapsed:.1f} s",
                      end="", file=sys.stderr, flush=True)
        elif self.done * 4 // self.total > self._shown:
            self._shown = self.done * 4 // self.total
            say(f"{self.label}: {self.done}/{self.total} tokens, {elapsed:.1f} s")

    def end(self) -> None:
        """Finish the line (on a terminal, where it was redrawn in place)."""
        if self._tty:
            print(file=sys.stderr, flush=True)
