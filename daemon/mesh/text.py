"""Turning generated token ids into streamed text, honouring stop strings."""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    """Incremental detokenizer: emits only text that can no longer change or be cut by a stop string.

    Token-by-token decoding breaks multi-byte characters and leading spaces, and
    decoding every id at every step costs O(n) per token. So each step decodes a
    short window: the ids since the last complete piece of text, with that piece's
    ids before them as context, and appends what the new ids added to it (the way
    vLLM and transformers' streamers detokenize). A piece that ends in a
    replacement character is held back until its bytes complete, and a tail that
    could still grow into a stop string is held back until it cannot.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None = None) -> None:
        self._decode = decode
        self._stop = [s for s in (stop or []) if s]
        self._ids: list[int] = []
        self._decoded = ""  # the text of ids[:_read]
        self._context = 0  # ids[_context:_read] decode to the end of _decoded: the window's context
        self._read = 0
        self._emitted = 0
        self.text = ""
        self.stopped = False

    def _decode_new(self) -> str:
        """The text of every id so far, decoding only the ids since the last complete piece."""
        ids = self._ids
        context = self._decode(ids[self._context:self._read])
        window = self._decode(ids[self._context:])
        if not window.startswith(context):  # a tokenizer whose text depends on more context: decode it all
            full = self._decode(ids)
            if not full.endswith("\ufffd"):
                self._decoded, self._context, self._read = full, max(0, len(ids) - 1), len(ids)
            return full
        piece = window[len(context):]
        if not piece or piece.endswith("\ufffd"):
            return self._decoded + piece  # nothing yet, or bytes still incomplete: the window grows, nothing moves
        self._decoded += piece
        self._context, self._read = self._read, len(ids)
        return self._decoded

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (maybe empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        full = self._decode_new()
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            return self._emit(full[:cut], cut)
        if full.endswith("\ufffd"):
            return ""
        return self._emit(full, len(full) - self._held_suffix(full))

    def finish(self) -> str:
        """Flush whatever was held back once generation ends."""
        if self.stopped:
            return ""
        full = self._decode(self._ids)
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            return self._emit(full[:cut], cut)
        return self._emit(full, len(full))

    def _emit(self, full: str, upto: int) -> str:
        self.text = full[:upto]
        delta = full[self._emitted : upto]
        self._emitted = max(self._emitted, upto)
        return delta

    def _first_stop(self, full: str) -> int | None:
        longest = max((len(s) for s in self._stop), default=0)
        search_from = max(0, self._emitted - longest)
        hits = [i for s in self._stop if (i := full.find(s, search_from)) != -1]
        return min(hits) if hits else None

    def _held_suffix(self, full: str) -> int:
        """Length of the longest end of ``full`` that is the start of a stop string."""
        held = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(full)), held, -1):
                if full.endswith(s[:n]):
                    held = n
                    break
        return held
