"""A chat conversation written out as Markdown (to read) and JSON (to process). No widgets here."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from meshtui.config import ChatSettings
from meshtui.state import GenerationRecord, MeshState

FORMAT = "meshtui.conversation/1"


def conversation_record(state: MeshState, settings: ChatSettings, now: float) -> dict:
    """The conversation shown, with what produced it: the model, the head's route, the sampling, each answer's stats."""
    model = state.model
    route = state.current_route
    return {
        "format": FORMAT,
        "exported_at": _iso(now),
        "head": state.head_url,
        "model": asdict(model) if model is not None else None,
        "route": [{"url": hop.url, "start_layer": hop.start_layer, "end_layer": hop.end_layer, "local": hop.local}
                  for hop in route.hops] if route is not None else None,
        "sampling": asdict(settings),
        "system_prompt": state.system_prompt or None,
        "messages": state.conversation_messages(),
        "answers": [_answer(record) for record in state.conversation_records if record.finished],
    }


def _answer(record: GenerationRecord) -> dict:
    return {
        "number": record.number,
        "prompt": record.prompt,
        "text": record.text,
        "outcome": record.outcome,
        "error": record.error,
        "started_at": _iso(record.started_at),
        "tokens": record.tokens,
        "tokens_per_second": record.tokens_per_second,
        "stats": asdict(record.stats) if record.stats is not None else None,
        "usage": asdict(record.usage) if record.usage is not None else None,
    }


def to_markdown(record: dict) -> str:
    """The conversation to read: the turns under headings, each answer's numbers in a line below it."""
    model = (record["model"] or {}).get("name") or "the mesh"
    lines = [f"# Conversation with {model}", ""]
    lines.append(f"Exported {record['exported_at']} from {record['head'] or 'no head'}.")
    if record["route"]:
        hops = ", ".join(f"{'local' if hop['local'] else hop['url']} {hop['start_layer']}-{hop['end_layer'] - 1}"
                         for hop in record["route"])
        lines.append(f"Route: {hops}.")
    sampling = record["sampling"]
    lines.append("Sampling: " + ", ".join(f"{name} {'random' if value is None else value}"
                                          for name, value in sampling.items()) + ".")
    if record["system_prompt"]:
        lines += ["", "## System", "", record["system_prompt"]]
    for answer in record["answers"]:
        lines += ["", "## You", "", answer["prompt"], "", f"## {model}", ""]
        if answer["text"]:
            lines += [answer["text"], ""]
        lines.append(f"*{_answer_line(answer)}*")
    return "\n".join(lines) + "\n"


def _answer_line(answer: dict) -> str:
    parts = [f"{answer['tokens']} tokens"]
    if answer["tokens_per_second"]:
        parts.append(f"{answer['tokens_per_second']:.1f} tok/s")
    if answer["outcome"] == "failed":
        parts.append(f"failed: {answer['error']}")
    elif answer["outcome"] != "done":
        parts.append(answer["outcome"])
    return " · ".join(parts)


def write_export(folder: Path, record: dict, now: float) -> tuple[Path, Path]:
    """Write ``chat-<local time>.md`` and ``.json`` into ``folder``; a second export in the same second gets ``-2``."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = "chat-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    name, n = stem, 1
    while (folder / f"{name}.md").exists() or (folder / f"{name}.json").exists():
        n += 1
        name = f"{stem}-{n}"
    markdown, data = folder / f"{name}.md", folder / f"{name}.json"
    markdown.write_text(to_markdown(record), encoding="utf-8")
    data.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return markdown, data


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(at))
