"""Speculative decoding across hops (``meshd bench --setups speculation``): a three-node mesh with and without
a draft model on its head, every remote hop behind a :class:`~daemon.bench.delay.DelayProxy` of each round trip
asked for (``--hop-rtt-ms``).

Both meshes run side by side, one generation of each in turn, so each pair sees the same load; a row's ratio is
the median of its pairs'. A row also says whether speculation gave the same tokens (it must: greedy), how
many drafted tokens the tail accepted, and how many tokens a verify step yielded.
"""

from __future__ import annotations

import os
import statistics

from daemon.bench.mesh import Mesh
from daemon.bench.progress import say


def measure(specs: list[tuple[str, list[str]]], model: str | None, threads: int | None, node_args: list[str], *,
            rtts: list[float], draft: list[str], tokens: int, times: int, precision: str) -> list[dict]:
    """Per round trip in ``rtts``: speculation off and on (``draft``: the head's --draft-* arguments)."""
    rows = []
    head_args = [(specs[0][0], specs[0][1] + draft)] + specs[1:]
    for rtt in rtts:
        say(f"starting two 3-node meshes in {precision}, {rtt:g} ms round trip per hop: speculation off and on")
        off = Mesh(f"3 nodes, {rtt:g} ms hops", specs, model, threads, node_args=node_args, hop_rtt_ms=rtt)
        try:
            on = Mesh(f"3 nodes, {rtt:g} ms hops, drafting", head_args, model, threads, node_args=node_args,
                      hop_rtt_ms=rtt)
        except BaseException:
            off.stop()
            raise
        try:
            off.generate(4)  # warm-up: connections, route measurements, lazy loads (and the draft model's)
            on.generate(4)
            pairs = []
            for _ in range(times):
                pairs.append((off.measure(tokens), on.measure(tokens)))
            rows.append(_row(rtt, pairs, tokens, precision, os.getloadavg()[0]))
        finally:
            on.stop()
            off.stop()
    return rows


def _row(rtt: float, pairs: list[tuple[dict, dict]], tokens: int, precision: str, load: float) -> dict:
    off = max((p[0] for p in pairs), key=lambda r: r["decode_tps"] or 0.0)
    on = max((p[1] for p in pairs), key=lambda r: r["decode_tps"] or 0.0)
    ratios = [b["decode_tps"] / a["decode_tps"] for a, b in pairs if a["decode_tps"] and b["decode_tps"]]
    drafted = sum(b["drafted_tokens"] for _, b in pairs)
    accepted = sum(b["accepted_tokens"] for _, b in pairs)
    verify = sum(b["verify_steps"] for _, b in pairs)
    return {
        "hop_rtt_ms": rtt, "precision": precision, "new_tokens": tokens, "runs": len(pairs),
        "off_tps": off["decode_tps"], "on_tps": on["decode_tps"],
        "ratio": statistics.median(ratios) if ratios else None, "paired_ratios": ratios,
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_verify": (accepted + verify) / verify if verify else None,
        "drafted_tokens": drafted, "accepted_tokens": accepted, "verify_steps": verify,
        "same_tokens": all(a["token_ids"] == b["token_ids"] for a, b in pairs),
        "load": load,
    }


def print_rows(rows: list[dict]) -> None:
    if not rows:
        return
    print()
    print("speculative decoding, 3 nodes, every remote hop behind a delay proxy: decode tok/s with the draft model "
          "off and on (best run each), on/off (the median of the pairs), drafted tokens accepted, tokens per verify "
          "step, same tokens")
    header = (f"{'hop rtt ms':>10} {'dtype':>8} {'tokens':>6} {'off tok/s':>9} {'on tok/s':>9} {'on/off':>6} "
              f"{'accepted':>8} {'tok/verify':>10} {'same':>4} {'load':>5}  pairs")
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        accepted = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        per = f"{r['tokens_per_verify']:.2f}" if r["tokens_per_verify"] is not None else "-"
        print(f"{r['hop_rtt_ms']:>10g} {r['precision']:>8} {r['new_tokens']:>6} {r['off_tps'] or 0:>9.2f} "
              f"{r['on_tps'] or 0:>9.2f} {ratio:>6} {accepted:>8} {per:>10} {'yes' if r['same_tokens'] else 'NO':>4} "
              f"{r['load']:>5.2f}  {' '.join(f'{x:.2f}' for x in r['paired_ratios'])}")
