"""What a node reports of its memory (``/v1/status``'s ``memory``): its peak and current resident set at one
instant, so the peak it reports is never under the resident set beside it."""

from __future__ import annotations

import builtins
import types

import torch

from daemon import host
from daemon.model.service import ShardService


def test_the_peak_and_the_resident_set_come_from_one_reading(monkeypatch):
    readings = []
    real_open = builtins.open

    def counted(path, *args, **kwargs):
        if str(path) == "/proc/self/status":
            readings.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counted)
    node = types.SimpleNamespace(shard=types.SimpleNamespace(device=torch.device("cpu")), runtime_rss_bytes=123)
    for _ in range(50):
        readings.clear()
        memory = ShardService.memory(node)
        assert len(readings) == 1
        assert memory.peak_rss_bytes >= memory.rss_bytes > 0 and memory.runtime_rss_bytes == 123


def test_status_fields_are_read_by_name_and_a_missing_one_is_none():
    found = host.proc_status_bytes("VmHWM", "VmRSS", "NoSuchField")
    assert found["VmHWM"] >= found["VmRSS"] > 0 and found["NoSuchField"] is None
    assert found["VmRSS"] % 1024 == 0
