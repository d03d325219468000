"""A mesh plan for people (a table and the command line for each node) and for programs (JSON)."""

from __future__ import annotations

from daemon.api import format_layers
from daemon.model.footprint import ModelFootprint, Precision
from daemon.plan.split import MeshPlan, NodePlan, format_bytes

_KIND_NAMES = {"full_attention": "full-attention", "sliding_attention": "sliding-window",
               "chunked_attention": "chunked-attention", "linear_attention": "linear-attention"}


def node_command(plan: MeshPlan, node: NodePlan, model: str | None) -> str:
    """The ``meshd`` command line that starts ``node`` as planned."""
    words = ["meshd"]
    if model:
        words += ["--model", model]
    words += ["--layers", format_layers(node.start, node.end)]
    words += ["--dtype", plan.precision.dtype]  # always: meshd's own default (auto) depends on the machine
    if plan.precision.quantize:
        words += ["--quantize", plan.precision.quantize]
    words += ["--kv-max-bytes", str(node.kv_room)]
    if node.sessions:
        words += ["--kv-max-sessions", str(node.sessions)]
    return " ".join(words)


def render_text(plan: MeshPlan, model: str | None) -> str:
    """The plan as a few lines of description, a table of nodes and each node's command line."""
    footprint, precision = plan.footprint, plan.precision
    lines = [f"{footprint.name} ({footprint.model_type}, {footprint.num_layers} layers) in {precision}; "
             f"sizes from {_source(footprint)}",
             *_describe_weights(footprint, precision),
             *_describe_caches(footprint, precision, plan.context),
             f"  reserve    {format_bytes(plan.reserve)} per node for meshd's own runtime", ""]
    if not plan.fits:
        return "\n".join(lines + _describe_misfit(plan)) + "\n"
    header = ("node", "memory", "layers", "weights", "KV room", "KV/token", "KV/session", "sessions")
    rows = [header] + [(str(i), format_bytes(n.memory), format_layers(n.start, n.end), format_bytes(n.weights_total),
                        format_bytes(n.kv_room), _maybe_bytes(n.kv_bytes_per_token), _maybe_bytes(n.session_bytes),
                        "?" if n.sessions is None else str(n.sessions))
                       for i, n in enumerate(plan.nodes)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if plan.sessions is None:
        lines.append(f"Sessions not estimated: {footprint.cache_unknown}.")
    elif plan.sessions == 0:
        lines.append(f"Some node has no room for a session of {plan.context} tokens: every step there would "
                     "re-run the whole sequence. Lower --context, or add memory.")
    else:
        lines.append(f"The mesh holds {plan.sessions} sessions of {plan.context} tokens at once "
                     "(the fewest of any node).")
    lines += ["", "Start each node with:"]
    lines += [f"  node {i}: {node_command(plan, node, model)}" for i, node in enumerate(plan.nodes)]
    return "\n".join(lines) + "\n"


def _source(footprint: ModelFootprint) -> str:
    if footprint.source == "config only":
        return "its config alone (no weights in the folder)"
    return f"its config, checked against its {footprint.source}"


def _maybe_bytes(n: int | None) -> str:
    return "?" if n is None else format_bytes(n)


def _describe_weights(footprint: ModelFootprint, precision: Precision) -> list[str]:
    sizes = footprint.layer_bytes(precision)
    each = (f"{format_bytes(sizes[0])} each" if len(set(sizes)) == 1
            else f"{format_bytes(min(sizes))} to {format_bytes(max(sizes))}")
    n = footprint.num_layers
    parts = footprint.weights_bytes(n, n, precision)
    head = "tied to the embeddings" if footprint.tied else format_bytes(footprint.lm_head.nbytes(precision))
    return [f"  weights    layers {each}, {format_bytes(sum(sizes))} in all; embeddings "
            f"{format_bytes(parts['embeddings'])} on every node (any node can head)",
            f"             the tail adds the final norm ({format_bytes(footprint.final_norm.nbytes(precision))}) "
            f"and the LM head ({head})"]


def _describe_caches(footprint: ModelFootprint, precision: Precision, context: int) -> list[str]:
    if footprint.caches is None:
        return [f"  KV cache   not estimated: {footprint.cache_unknown}"]
    groups: dict[tuple, int] = {}
    for cache in footprint.caches:
        key = (cache.kind, cache.values_per_token, cache.window, cache.state_values, cache.state_bytes)
        groups[key] = groups.get(key, 0) + 1
    lines = []
    for (kind, per_token, window, state_values, state_bytes), count in groups.items():
        name = f"{count} {_KIND_NAMES.get(kind, kind)} layer{'s' if count > 1 else ''}"
        if per_token:
            cap = f", at most {window} tokens" if window else ""
            lines.append(f"{format_bytes(per_token * precision.value_bytes)} per token per layer on {name}{cap}")
        elif state_values or state_bytes:
            fixed = state_values * precision.value_bytes + state_bytes
            lines.append(f"{format_bytes(fixed)} per session per layer on {name}, whatever its length")
        else:
            lines.append(f"nothing on {name}")
    full = next((c for c in footprint.caches if c.values_per_token and c.window is None), None)
    if full is not None:
        lines.append(f"a session of {context} tokens may hold {full.planned_positions(context)} positions per "
                     "full-attention layer (the cache grows in place with room to spare)")
    return [f"  KV cache   {lines[0]}", *(f"             {line}" for line in lines[1:])]


def _describe_misfit(plan: MeshPlan) -> list[str]:
    lines = [f"Does not fit: {plan.problem}."]
    if plan.extra_node:
        lines.append(f"  another node of {format_bytes(plan.extra_node)} at the end of the route would make it fit")
    for alternative in plan.alternatives:
        change = _precision_flags(alternative.precision)
        if not alternative.fits:
            lines.append(f"  with {change}: does not fit either")
        elif alternative.sessions is None:
            lines.append(f"  with {change}: fits")
        else:
            lines.append(f"  with {change}: fits, {alternative.sessions} sessions of {plan.context} tokens")
    return lines


def _precision_flags(precision: Precision) -> str:
    flags = [f"--dtype {precision.dtype}"] if precision.dtype != "float32" else []
    if precision.quantize:
        flags.append(f"--quantize {precision.quantize}")
    return " ".join(flags)


def plan_json(plan: MeshPlan, model: str | None) -> dict:
    """The same plan as the table, as JSON-ready data (bytes as integers, layer ranges inclusive)."""
    footprint, precision = plan.footprint, plan.precision
    n = footprint.num_layers
    return {
        "model": {"name": footprint.name, "model_type": footprint.model_type, "layers": n,
                  "source": footprint.source, "tied_embeddings": footprint.tied,
                  "max_positions": footprint.max_positions},
        "dtype": precision.dtype,
        "quantize": precision.quantize,
        "context": plan.context,
        "reserve_bytes": plan.reserve,
        "layer_bytes": footprint.layer_bytes(precision),
        "embeddings_bytes": footprint.embeddings.nbytes(precision),
        "final_norm_bytes": footprint.final_norm.nbytes(precision),
        "lm_head_bytes": footprint.lm_head.nbytes(precision),
        "kv_bytes_per_token_per_layer": None if footprint.caches is None else
        [footprint.kv_bytes_per_token(j, j + 1, precision) for j in range(n)],
        "kv_unknown": footprint.cache_unknown,
        "fits": plan.fits,
        "sessions": plan.sessions,
        "nodes": [{"memory_bytes": node.memory, "layers": format_layers(node.start, node.end),
                   "start": node.start, "last": node.end - 1, "weights_bytes": node.weights,
                   "weights_total_bytes": node.weights_total, "kv_max_bytes": node.kv_room,
                   "kv_bytes_per_token": node.kv_bytes_per_token, "session_bytes": node.session_bytes,
                   "sessions": node.sessions, "command": node_command(plan, node, model)}
                  for node in plan.nodes or ()],
        "problem": plan.problem,
        "shortfall_bytes": plan.shortfall,
        "extra_node_bytes": plan.extra_node,
        "alternatives": [{"dtype": a.precision.dtype, "quantize": a.precision.quantize, "fits": a.fits,
                          "sessions": a.sessions} for a in plan.alternatives],
    }
