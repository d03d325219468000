"""How numbers, times and addresses read on screen."""

from __future__ import annotations

import time
from pathlib import Path


def home_relative(path: Path) -> str:
    """``~/...`` for a path under the home folder: shorter in a notification."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def short_url(url: str) -> str:
    """``http://127.0.0.1:7070`` -> ``127.0.0.1:7070``: the scheme only costs columns."""
    return url.split("://", 1)[-1]


def short_node(url: str, head_url: str | None) -> str:
    """A node as a compact list names it: ``:7071`` when it shares the head's host, else ``host:port``."""
    address = short_url(url)
    host, _, port = address.rpartition(":")
    if head_url is not None and host and host == short_url(head_url).rpartition(":")[0]:
        return f":{port}"
    return address


def format_clock(seconds: float) -> str:
    """A Unix time as the local wall clock, ``13:02:11``."""
    return time.strftime("%H:%M:%S", time.localtime(seconds))


def format_bytes(count: int | None) -> str:
    if count is None:
        return "—"
    size = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m 15s``; whole seconds, since that is how fast the countdowns tick."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def format_rate(value: float | None, unit: str = "tok/s") -> str:
    if value is None:
        return "—"
    return f"{value:.1f} {unit}" if unit else f"{value:.1f}"


def format_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f} ms"


def plural(count: int, singular: str, many: str | None = None) -> str:
    return f"{count} {singular if count == 1 else many or singular + 's'}"
