"""Structured logs: every line carries the node and the request id of the generation it serves.

The request id comes from the client's ``X-Request-Id`` (or is made up by the head),
travels to every node of the route in the same header, and is kept in a context
variable, so a log line anywhere inside a request's handling names it without
being passed around. ``--log-format json`` writes one JSON object per line
(python-json-logger); ``text`` is for people; ``auto`` picks text on a terminal.
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
import uuid

REQUEST_ID_HEADER = "X-Request-Id"
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_VALID_ID = re.compile(r"[A-Za-z0-9._:\-]{1,64}")


def request_id_from(header: str | None) -> str:
    """The caller's request id when it is a sane token, else a new one (never echo junk into logs)."""
    if header is not None and _VALID_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex[:16]


class _Context(logging.Filter):
    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        record.node = self.node
        return True


def setup_logging(*, level: str, fmt: str, node: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Context(node))
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s %(node)s %(request_id)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        ))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
