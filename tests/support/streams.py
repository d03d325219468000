"""A streaming chat request a test reads token by token, so it can act mid-generation (kill, drain, restart)."""

from __future__ import annotations

from tests.support.meshd import Daemon


class Stream:
    """A streaming chat request read chunk by chunk, so a test can act mid-generation."""

    def __init__(self, head: Daemon, body: dict) -> None:
        self._events = head.stream(body)
        first = next(self._events)
        self.session_id = first["id"].removeprefix("chatcmpl-")
        self.chunks: list[dict] = [first]

    def read_tokens(self, count: int) -> None:
        seen = 0
        for event in self._events:
            self.chunks.append(event)
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                seen += 1
                if seen == count:
                    return
        raise AssertionError(f"the stream ended after {seen} of {count} tokens: {self.chunks[-3:]}")

    def finish(self) -> dict:
        """Read to the end; the final chunk's ``meshnet`` stats (or the error event, if one came)."""
        self.chunks.extend(self._events)
        errors = [c for c in self.chunks if "error" in c]
        if errors:
            return errors[-1]
        final = [c for c in self.chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
        assert final, self.chunks[-3:]
        return final[-1]["meshnet"]
