"""Prompt reuse measured (issue 14): a multi-turn chat warm against cold, and concurrent clients sharing one
system prompt.

Both run on a two-node cached mesh started with ``--prefix-reuse client``, where a request starts only from
what requests with the same OpenAI ``user`` left on the mesh. A *warm* request (a chat's next turn, a client
of a group with one system prompt) is sent under its chat's or group's user; the *cold* one, the same
request, under a user of its own, so the head finds nothing to start from and computes the whole prompt, as
with ``--prefix-reuse off``. Warm and cold thus run on the same processes with the same memory, one straight
after the other under the same load; the matching is the default ``shared`` policy's, only whose sessions are
candidates differs. TTFT is what a client sees: from sending the request to the first streamed text.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence

from daemon.bench.mesh import Mesh, at_once, counter_value
from daemon.bench.progress import Progress, say
from daemon.mesh.prefix import common_prefix

REUSE_BY_USER = ["--prefix-reuse", "client"]  # the nodes' option: warm and cold told apart by the user

# one system prompt for both setups: about 500 tokens in SmolLM2's tokenizer
SYSTEM_PROMPT = (
    "You are Harbour, the help desk assistant of a small cooperative that runs a community mesh network in a "
    "coastal town. Members share spare computers to run a language model together, each machine holding a "
    "slice of the model's layers, and they reach the model from laptops, phones and a console in the library.\n\n"
    "Who you talk to. Most people who write to you are volunteers, not engineers: fishermen who lend an old "
    "desktop, teachers who run a node in the school, retired members who keep the library's machine going. "
    "Assume good faith and no special knowledge. When someone uses a technical word, answer at their level.\n\n"
    "How you answer. Keep answers short: two to five sentences unless the person asks for detail or a step by "
    "step guide. Say the most useful thing first. Use plain words; explain a term the first time you use it. "
    "Give commands on a line of their own. When you are not sure, say so and suggest how to find out, for "
    "example by looking at the node's status page or asking the coordinator on duty. Never invent a command, a "
    "setting or a number. If a question is outside what you know about the network, say so and point to the "
    "members' forum.\n\n"
    "What you know. A node is one computer running the mesh daemon. Each node holds a range of layers, and a "
    "request travels through the nodes in layer order; the first node is called the head and the last one the "
    "tail. The head turns the conversation into tokens, sends activations from node to node, and streams the "
    "answer back. Nodes remember the work already done for a conversation, so a follow-up question only needs "
    "the new words to be computed. If a node goes away, the head finds another node with the same layers and "
    "carries on. The console shows each node, its layers, its memory and the requests it is serving. A new "
    "node needs a wired connection, at least eight gigabytes of memory and a machine that can stay on through "
    "the night.\n\n"
    "Safety and privacy. Conversations pass through several members' machines. Remind people not to share "
    "passwords, health details or anything they would not say in the library. Do not ask for personal "
    "information. If someone reports a machine that overheats or smells of burning, tell them to switch it off "
    "at the wall first and report it afterwards.\n\n"
    "Tone. Be warm, patient and practical. Thank volunteers for their machines. Do not use emoji."
)

# the chat's user turns, asked in this order; each answer goes back into the history
USER_TURNS = (
    "Hello! I have an old desktop in my shed. Could it become a node?",
    "It has four gigabytes of memory. Is that enough?",
    "What does the head do that the other nodes do not?",
    "If my machine is switched off in the middle of an answer, what happens?",
    "Can other members read what I ask the model?",
    "Thank you. What should I tell the coordinator when I sign up?",
)

# the concurrent clients' own questions after the shared system prompt, one each
QUESTIONS = (
    "How do I see which layers my node holds?",
    "The fan of my laptop is very loud tonight. Should I worry?",
    "Why is the first answer of the day slower than the rest?",
    "Can I run a node on a machine that is on wifi?",
    "Who decides which layers a new node gets?",
    "What is the console in the library for?",
    "Is it safe to ask the model about my medicine?",
    "My node shows as down. What can I check first?",
)


def multiturn_chat(mesh: Mesh, tokens: int) -> list[dict]:
    """The chat of :data:`USER_TURNS` after :data:`SYSTEM_PROMPT`, each turn asked cold and straight after
    warm, ``tokens`` new tokens at most, greedy; a row per turn (:func:`turn_row`). The history carries the
    warm answers, so both requests of a turn have the same prompt."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    rows = []
    for turn, text in enumerate(USER_TURNS, 1):
        messages.append({"role": "user", "content": text})
        cold = mesh.chat(messages, tokens, user=f"bench-cold-{turn}")
        warm = mesh.chat(messages, tokens, user="bench-chat")
        row = turn_row(turn, warm, cold) | {"load": os.getloadavg()[0]}
        rows.append(row)
        say(f"{mesh.name}, turn {turn}/{len(USER_TURNS)}: {row['prompt_tokens']} prompt tokens, "
            f"{row['cached_tokens']} reused; TTFT warm {row['ttft_warm_ms']:.0f} ms, cold {row['ttft_cold_ms']:.0f} ms")
        messages.append({"role": "assistant", "content": warm["text"]})
    return rows


def turn_row(turn: int, warm: dict, cold: dict) -> dict:
    """One turn's numbers from its warm and cold answers (:meth:`Mesh.chat`)."""
    return {
        "turn": turn,
        "prompt_tokens": warm["prompt_tokens"],
        "cached_tokens": warm["cached_tokens"],
        "computed_tokens": warm["prompt_computed_tokens"],
        "cold_cached_tokens": cold["cached_tokens"],
        "cold_computed_tokens": cold["prompt_computed_tokens"],
        "ttft_warm_ms": warm["ttft_ms"],
        "ttft_cold_ms": cold["ttft_ms"],
        "ttft_ratio": ratio(warm["ttft_ms"], cold["ttft_ms"]),
        # the head's own clocks: from its generation's start (after tokenizing) to the first token, and the
        # prompt's first step
        "first_token_ms_warm": warm["first_token_ms"],
        "first_token_ms_cold": cold["first_token_ms"],
        "prefill_ms_warm": warm["prefill_ms"],
        "prefill_ms_cold": cold["prefill_ms"],
        "reprefills": warm["reprefills"] + cold["reprefills"],
        "tokens_match": warm["token_ids"] == cold["token_ids"],
        "token_ids": warm["token_ids"],
    }


def client_messages(client: int) -> list[dict]:
    """Client ``client``'s chat in the shared-prefix setup: the system prompt and a question of its own."""
    question = QUESTIONS[client % len(QUESTIONS)]
    if client >= len(QUESTIONS):
        question += f" (Member {client + 1} asking.)"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def clients_at_once(mesh: Mesh, clients: int, tokens: int, encode: Callable[[list[dict]], list[int]]) -> list[dict]:
    """``clients`` chats sent at once, each :data:`SYSTEM_PROMPT` and a question of its own, ``tokens`` new
    tokens at most: first cold (a user each), then warm (one user for all); a row for each (:func:`group_row`).
    ``encode``: the head's chat template, to count the tokens all prompts share and each one's own."""
    chats = [client_messages(i) for i in range(clients)]
    prompts = [encode(chat) for chat in chats]
    shared, own = shared_and_own(prompts)
    cold = _together(mesh, chats, tokens, [f"bench-cold-{i}" for i in range(clients)], "cold")
    warm = _together(mesh, chats, tokens, ["bench-group"] * clients, "warm")
    if [a["prompt_tokens"] for a in warm[0]] != [len(p) for p in prompts]:
        raise RuntimeError("the head tokenized the clients' prompts differently from the bench")
    same = all(w["token_ids"] == c["token_ids"] for w, c in zip(warm[0], cold[0]))
    return [group_row(reuse, answers, wall, from_metrics, shared, own) | {"tokens_match": same}
            for reuse, (answers, wall, from_metrics) in ((False, cold), (True, warm))]


def group_row(reuse: bool, answers: list[dict], wall_s: float, metrics_computed: float | None, shared: int,
              own: Sequence[int]) -> dict:
    """A group of concurrent clients' numbers: the prompt tokens the mesh computed for them against one system
    prompt's tokens (``shared``) plus each client's ``own`` after it, the least any mesh must compute."""
    ideal = shared + sum(own)
    computed = sum(a["prompt_computed_tokens"] for a in answers)
    ttfts = [a["ttft_ms"] for a in answers]
    return {
        "reuse": reuse,
        "clients": len(answers),
        "prompt_tokens": sum(a["prompt_tokens"] for a in answers),
        "shared_tokens": shared,
        "own_tokens": sum(own),
        "ideal_tokens": ideal,
        "cached_tokens": sum(a["cached_tokens"] for a in answers),
        "computed_tokens": computed,
        "metrics_computed_tokens": metrics_computed,  # the head's meshnet_prompt_tokens_total{kind="computed"}
        "computed_ratio": ratio(computed, ideal),
        "wall_s": wall_s,
        "mean_ttft_ms": statistics.mean(ttfts),
        "max_ttft_ms": max(ttfts),
        "reprefills": sum(a["reprefills"] for a in answers),
        "token_ids": [a["token_ids"] for a in answers],  # per client
        "load": os.getloadavg()[0],
    }


def _together(mesh: Mesh, chats: list[list[dict]], tokens: int, users: list[str],
              label: str) -> tuple[list[dict], float, float | None]:
    """Every chat at once, one thread and connection each: the answers in order, the wall time from the
    start to the last answer, and the computed prompt tokens the head's ``/metrics`` counted meanwhile."""
    progress = Progress(f"{mesh.name}, {len(chats)} clients at once, {label}", len(chats) * tokens)
    before = mesh.metrics()
    try:
        answers, wall = at_once([functools.partial(mesh.chat, chat, tokens, user=user, progress=progress)
                                 for chat, user in zip(chats, users)])
    finally:
        progress.end()
    return answers, wall, _computed_since(mesh, before, len(chats))


def _computed_since(mesh: Mesh, before: str, generations: int) -> float | None:
    """Computed prompt tokens the head counted since ``before`` (its ``/metrics`` then), once it has counted
    ``generations`` more generations (it counts each as its answer's stream closes); None if it never does."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        after = mesh.metrics()
        if counter_value(after, "meshnet_generations_total") >= counter_value(before, "meshnet_generations_total") \
                + generations:
            return (counter_value(after, "meshnet_prompt_tokens_total", kind="computed")
                    - counter_value(before, "meshnet_prompt_tokens_total", kind="computed"))
        time.sleep(0.05)
    return None


def shared_and_own(prompts: Sequence[Sequence[int]]) -> tuple[int, list[int]]:
    """How many leading token ids every prompt shares, and how many each has after them."""
    shared = min(len(p) for p in prompts)
    for prompt in prompts[1:]:
        shared = common_prefix(prompts[0], prompt, shared)
    return shared, [len(p) - shared for p in prompts]


def ratio(part: float | None, whole: float | None) -> float | None:
    """``part / whole``; None where either is missing or ``whole`` is not positive."""
    return part / whole if part is not None and whole is not None and whole > 0 else None
