"""Decode steps of several sessions as one forward (``daemon.model.batching``, ``daemon.model.steps``).

Issue 15, "batching" and "exactness". On the built-in model and on the tiny architecture matrix, sessions of
different lengths decoding together give each session the tokens of its own single-session run; the logits
of a batched step are within a measured bound of a single step's (rows of a batched matrix product are not
bitwise single-row products); layers that cannot batch are refused with their reason; a miss or a failure
affects only its own session; and the queue batches what waits together and nothing else.
"""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest
import torch

from daemon.api import Sampling
from daemon.errors import CacheMiss
from daemon.kvstore import SessionCacheStore
from daemon.model import steps as steps_module
from daemon.model.batching import BATCHING_LAYER_TYPES, SLICED_HEAD_ROWS, batching_refusal
from daemon.model.shard import DecodeStep, ModelShard
from daemon.model.steps import StepQueue
from tests.unit.test_architectures import SPLITS, arch_param

GREEDY = Sampling()
PROMPTS = [  # ids in the built-in vocabulary, of different lengths: sessions at different positions
    [1, 504, 3158, 1567, 4829, 28, 2117, 314, 17843],
    [1, 9690, 198, 2683, 253, 6469],
    [1, 504, 6376, 314, 4461, 281, 827, 8545, 975, 30, 2114, 1410, 288, 260],
    [1, 19556, 17],
]
# the largest difference of a batched step's logits from a single step's, float32, measured on the built-in
# model over 4 sessions x 24 steps: 1.1e-5 (logits of size ~20); the bound leaves room for other CPUs' kernels
LOGIT_BOUND = {torch.float32: 1e-4}


def store() -> SessionCacheStore:
    return SessionCacheStore(ttl_seconds=600, max_sessions=64, max_bytes=None)


def run_alone(shard: ModelShard, prompt: list[int], steps: int, session: str) -> tuple[list[int], list]:
    """A session's greedy tokens and each decode step's logits, every step alone."""
    result = shard.step(shard.embed(prompt), mode="prefill", session_id=session, past_len=0, start_layer=shard.start,
                        sampling=GREEDY)
    tokens, logits = [result.token_id], []
    for _ in range(steps):
        past = len(prompt) + len(tokens) - 1
        cache = shard.sessions.checkout(session, past_len=past, start_layer=shard.start).cache
        hidden = shard.run_layers(shard.embed(tokens[-1:]), start_layer=shard.start, past_len=past,
                                  cache=copy.deepcopy(cache))
        logits.append(shard.logits_last(hidden))
        tokens.append(shard.step(shard.embed(tokens[-1:]), mode="decode", session_id=session, past_len=past,
                                 start_layer=shard.start, sampling=GREEDY).token_id)
    return tokens, logits


def run_together(shard: ModelShard, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list]:
    """The same sessions decoding together: every decode step one batch of all of them."""
    tokens, logits = [], []
    for i, prompt in enumerate(prompts):
        tokens.append([shard.step(shard.embed(prompt), mode="prefill", session_id=f"b{i}", past_len=0,
                                  start_layer=shard.start, sampling=GREEDY).token_id])
    for _ in range(steps):
        pasts = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens)]
        caches = [copy.deepcopy(shard.sessions.checkout(f"b{i}", past_len=past, start_layer=shard.start).cache)
                  for i, past in enumerate(pasts)]
        hidden = shard.run_batch(torch.cat([shard.embed(t[-1:]) for t in tokens], dim=1), start_layer=shard.start,
                                 position_ids=torch.tensor([pasts]), caches=caches)
        logits.append(shard.logits_rows(hidden))
        batch = [DecodeStep(shard.embed(t[-1:]), f"b{i}", past, GREEDY)
                 for i, (t, past) in enumerate(zip(tokens, pasts))]
        for t, outcome in zip(tokens, shard.step_batch(batch, start_layer=shard.start)):
            assert not isinstance(outcome, Exception), outcome
            t.append(outcome.token_id)
    return tokens, logits


@pytest.fixture(scope="module")
def built_in(default_model):
    torch.set_num_threads(2)
    return ModelShard(default_model, 0, 30, kv_cache=True, sessions=store())


@pytest.mark.slow  # 4 sessions x 24 steps, each alone and batched: in .ci/run; the tiny llama runs in the fast set
def test_sessions_decoding_together_get_their_own_tokens_within_the_logit_bound(built_in):
    steps = 24
    together, batched_logits = run_together(built_in, PROMPTS, steps)
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        alone, logits = run_alone(built_in, prompt, steps, f"alone{i}")
        assert together[i] == alone, f"session {i}: batched {together[i]} != alone {alone}"
        for step, single in enumerate(logits):
            worst = max(worst, (batched_logits[step][i] - single).abs().max().item())
    print(f"\nlargest batched-vs-single logit difference, float32: {worst:.2e}")
    assert worst <= LOGIT_BOUND[torch.float32]


@pytest.mark.parametrize("rows", [4, 8, 15])
def test_the_lm_head_over_a_batchs_rows_in_slices_is_each_rows_own_within_the_logit_bound(built_in, rows):
    # a batch of these sizes takes the sliced LM head on the CPU in float32: each row's logits against that row
    # through the whole head alone (a slice out of place or out of order is off by the logits themselves)
    assert rows in SLICED_HEAD_ROWS
    generator = torch.Generator().manual_seed(rows)
    hidden = torch.randn(1, rows, built_in.info.hidden_size, generator=generator)
    together = built_in.logits_rows(hidden)
    assert together.shape == (rows, built_in.info.vocab_size)
    for row in range(rows):
        alone = built_in.logits_rows(hidden[:, row:row + 1])[0]
        assert (together[row] - alone).abs().max().item() <= LOGIT_BOUND[torch.float32], f"row {row}"


def test_a_session_that_misses_leaves_the_rest_of_its_batch_running(built_in):
    shard = built_in
    firsts = [shard.step(shard.embed(p), mode="prefill", session_id=f"m{i}", past_len=0, start_layer=0,
                         sampling=GREEDY).token_id for i, p in enumerate(PROMPTS[:3])]
    batch = [DecodeStep(shard.embed([t]), f"m{i}", len(p), GREEDY)
             for i, (t, p) in enumerate(zip(firsts, PROMPTS[:3]))]
    batch[1] = DecodeStep(batch[1].hidden, "m1", len(PROMPTS[1]) + 5, GREEDY)  # a position the cache is not at
    batch.append(DecodeStep(shard.embed([firsts[0]]), "never-prefilled", 3, GREEDY))
    outcomes = shard.step_batch(batch, start_layer=0)
    assert isinstance(outcomes[1], CacheMiss) and outcomes[1].reason == "past_len_mismatch"
    assert isinstance(outcomes[3], CacheMiss) and outcomes[3].reason == "unknown_session"
    for i in (0, 2):  # the others ran, and their next steps follow on
        assert not isinstance(outcomes[i], Exception), outcomes[i]
        entry = shard.sessions.checkout(f"m{i}", past_len=len(PROMPTS[i]) + 1, start_layer=0)
        assert entry.past_len == len(PROMPTS[i]) + 1


def test_sessions_starting_from_held_prefixes_batch_with_running_ones_and_get_their_own_tokens(built_in):
    # concurrent clients of one prompt begin with one step each from the prompt the node already holds: copies
    # of one prefix, a prefix taken over, and a prefix that is gone, batched with a session already decoding
    shard = built_in
    held, running = PROMPTS[2], PROMPTS[0]
    for source in ("held", "held-taken"):
        shard.step(shard.embed(held), mode="prefill", session_id=source, past_len=0, start_layer=0, sampling=GREEDY)
    first = shard.step(shard.embed(running), mode="prefill", session_id="running", past_len=0, start_layer=0,
                       sampling=GREEDY).token_id
    keep = len(held) - 1  # the prompt's last token is computed again: its logits give the first token
    alone = shard.step(shard.embed(held[-1:]), mode="decode", session_id="alone", past_len=keep, start_layer=0,
                       sampling=GREEDY, prefix="held").token_id
    running_alone = shard.step(shard.embed([first]), mode="decode", session_id="running-alone", past_len=len(running),
                               start_layer=0, sampling=GREEDY, prefix="running").token_id
    last = shard.embed(held[-1:])
    batch = [DecodeStep(last, "copy0", keep, GREEDY, prefix="held"),
             DecodeStep(shard.embed([first]), "running", len(running), GREEDY),
             DecodeStep(last, "copy1", keep, GREEDY, prefix="held"),
             DecodeStep(last, "taken", keep, GREEDY, prefix="held-taken", take_prefix=True),
             DecodeStep(last, "orphan", keep, GREEDY, prefix="never-held")]
    outcomes = shard.step_batch(batch, start_layer=0)
    assert isinstance(outcomes[4], CacheMiss) and outcomes[4].reason == "prefix_unavailable"
    assert [o.token_id for o in outcomes[:4]] == [alone, running_alone, alone, alone]
    for session, past in [("copy0", keep + 1), ("copy1", keep + 1), ("taken", keep + 1),
                          ("running", len(running) + 1), ("held", len(held))]:
        assert shard.sessions.checkout(session, past_len=past, start_layer=0).past_len == past
    with pytest.raises(CacheMiss):  # moved to "taken", not copied
        shard.sessions.checkout("held-taken", past_len=len(held), start_layer=0)


def test_a_batch_that_fails_drops_its_sessions_so_their_next_steps_miss(built_in, monkeypatch):
    shard = built_in
    for i, p in enumerate(PROMPTS[:2]):
        shard.step(shard.embed(p), mode="prefill", session_id=f"f{i}", past_len=0, start_layer=0, sampling=GREEDY)
    monkeypatch.setattr(shard, "run_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    batch = [DecodeStep(shard.embed([5]), f"f{i}", len(p), GREEDY) for i, p in enumerate(PROMPTS[:2])]
    outcomes = shard.step_batch(batch, start_layer=0)
    assert all(isinstance(o, RuntimeError) for o in outcomes)
    for i, p in enumerate(PROMPTS[:2]):  # a later decode misses: the head re-prefills, never reads a torn cache
        with pytest.raises(CacheMiss):
            shard.sessions.checkout(f"f{i}", past_len=len(p), start_layer=0)


@pytest.mark.parametrize("arch", [arch_param(arch, id=arch) for arch in SPLITS])
def test_the_architecture_matrix_batches_exactly_or_says_why_not(arch, tiny_model):
    """Every tiny architecture batches (full-attention, sliding-window and linear-attention layers) with each
    session's own tokens and logits, or is refused by its layer types."""
    torch.set_num_threads(2)
    shard = ModelShard(tiny_model(arch), 0, 4, kv_cache=True, sessions=store())
    types = set(shard.layer_types)
    if not types <= BATCHING_LAYER_TYPES:
        assert shard.batch_refusal is not None, f"{arch} has {types} layers and was not refused"
        for other in types - BATCHING_LAYER_TYPES:
            assert other in shard.batch_refusal
        return
    assert shard.batch_refusal is None, shard.batch_refusal
    steps = 10  # the tiny sliding layers' window is 4: every session's steps pass it, the 3-token prompt's at once
    together, batched_logits = run_together(shard, PROMPTS, steps)
    for i, prompt in enumerate(PROMPTS):
        alone, logits = run_alone(shard, prompt, steps, f"alone{i}")
        assert together[i] == alone, f"{arch} session {i}"
        for step, single in enumerate(logits):  # a wrong window or rotary is off by the logits themselves
            scale = single.abs().max().item()
            assert (batched_logits[step][i] - single).abs().max().item() <= 1e-4 * scale, f"{arch} {i} {step}"


def test_layer_types_that_batch_and_those_refused_by_name():
    assert batching_refusal(["linear_attention", "full_attention", "sliding_attention"], caches=True) is None
    refusal = batching_refusal(["full_attention", "mamba", "conv"], caches=True)
    assert refusal is not None and "conv, mamba" in refusal
    assert "stateless" in batching_refusal(["full_attention"], caches=False)


def test_a_stateless_node_never_batches(default_model):
    shard = ModelShard(default_model, 15, 30, kv_cache=False, sessions=store())
    assert "stateless" in shard.batch_refusal


# ---- the queue ---------------------------------------------------------------------------------------------


def request(session: str, *, mode: str = "decode", tokens: int = 1, start_layer: int = 0, prefix=None):
    return SimpleNamespace(session_id=session, mode=mode, start_layer=start_layer, prefix=prefix,
                           activation=SimpleNamespace(shape=(1, tokens, 8)))


class BusyThread:
    """A stand-in torch thread whose first call computes until released: what arrives meanwhile waits."""

    def __init__(self, outcome=lambda job: job.request.session_id) -> None:
        self.batches: list[list[str]] = []
        self.entered, self.release = asyncio.Event(), asyncio.Event()
        self.outcome = outcome

    async def run(self, fn, jobs):
        if not self.entered.is_set():
            self.entered.set()
            await self.release.wait()
        return fn(jobs)

    def run_batch(self, jobs):
        self.batches.append([job.request.session_id for job in jobs])
        return [self.outcome(job) for job in jobs]


async def queue_run(submissions, *, max_batch: int = 16):
    """Submit ``submissions`` while the torch thread is busy with a first step; returns the batches run."""
    thread = BusyThread()
    queue = StepQueue(thread.run_batch, thread.run, max_batch=max_batch)
    first = asyncio.ensure_future(queue.submit(request("first"), None))
    await thread.entered.wait()
    others = [asyncio.ensure_future(queue.submit(r, None)) for r in submissions]
    await asyncio.sleep(0)
    thread.release.set()
    results = await asyncio.gather(first, *others)
    assert results == ["first", *[r.session_id for r in submissions]]  # each gets its own outcome
    return thread.batches


def test_decode_steps_waiting_together_run_as_one_batch_and_other_steps_alone_in_order():
    batches = asyncio.run(queue_run([
        request("a"), request("b"),
        request("p", mode="prefill", tokens=40),  # alone: after the batch ahead of it
        request("c"),
        request("x", tokens=3),  # a prompt extending a session: alone
        request("d", start_layer=5),  # another start layer: a batch of its own
        request("e", prefix="s0"),  # a session's first step from a held prefix: batches too
        request("f", prefix="a"),  # starts from a session the batch steps: not in that batch
        request("g", prefix="s0"),  # copies the prefix e copies: batches with it
    ]))
    assert batches == [["first"], ["a", "b", "c", "e", "g"], ["p"], ["x"], ["d"], ["f"]]


def test_the_batch_size_is_capped():
    batches = asyncio.run(queue_run([request(f"s{i}") for i in range(7)], max_batch=3))
    assert batches == [["first"], ["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6"]]


def test_a_cap_of_one_runs_every_step_alone():
    batches = asyncio.run(queue_run([request(f"s{i}") for i in range(3)], max_batch=1))
    assert batches == [["first"], ["s0"], ["s1"], ["s2"]]


def test_steps_arriving_together_at_an_idle_node_start_as_one_batch():
    async def scenario():
        thread = BusyThread()
        thread.entered.set()  # never busy
        queue = StepQueue(thread.run_batch, thread.run, max_batch=16)
        await asyncio.gather(*(queue.submit(request(f"s{i}"), None) for i in range(4)))
        return thread.batches

    assert asyncio.run(scenario()) == [["s0", "s1", "s2", "s3"]]


def test_steps_that_keep_arriving_a_little_apart_start_as_one_batch(monkeypatch):
    # a batch's replies reach the next node one after another: the wait counts from the latest arrival, so 8
    # sessions' steps 4 windows apart in all still run together; a session that does not come back (it ended)
    # holds the others one window after the last arrival, not longer
    monkeypatch.setattr(steps_module, "COALESCE_SECONDS", 0.1)
    monkeypatch.setattr(steps_module, "COALESCE_WHILE_OTHERS_COMPUTE_SECONDS", 30.0)

    async def scenario():
        thread = BusyThread()
        thread.entered.set()  # never busy
        queue = StepQueue(thread.run_batch, thread.run, max_batch=16)
        sessions = [f"s{i}" for i in range(8)]
        await asyncio.gather(*(queue.submit(request(s), None) for s in sessions))  # all seen decoding here

        async def arrive(i: int, session: str):
            await asyncio.sleep(0.05 * i)
            return await queue.submit(request(session), None)

        await asyncio.gather(*(arrive(i, s) for i, s in enumerate(sessions)))
        started = asyncio.get_running_loop().time()
        await asyncio.gather(*(arrive(i, s) for i, s in enumerate(sessions[:7])))  # s7 ended
        return thread.batches, asyncio.get_running_loop().time() - started

    batches, waited = asyncio.run(scenario())
    assert batches == [[f"s{i}" for i in range(8)]] * 2 + [[f"s{i}" for i in range(7)]]
    assert waited < 0.3 + 0.1 + 0.5  # the last arrival at 0.3 s, one window, room for a slow host


def test_a_step_whose_client_left_is_not_run():
    async def scenario():
        thread = BusyThread()
        queue = StepQueue(thread.run_batch, thread.run, max_batch=16)
        first = asyncio.ensure_future(queue.submit(request("first"), None))
        await thread.entered.wait()
        gone = asyncio.ensure_future(queue.submit(request("gone"), None))
        stays = asyncio.ensure_future(queue.submit(request("stays"), None))
        await asyncio.sleep(0)
        gone.cancel()
        thread.release.set()
        await asyncio.gather(first, stays)
        return thread.batches

    assert asyncio.run(scenario()) == [["first"], ["stays"]]


def test_a_failed_step_fails_only_its_own_request():
    async def scenario():
        thread = BusyThread(lambda job: ValueError("bad") if job.request.session_id == "bad" else "ok")
        thread.entered.set()
        queue = StepQueue(thread.run_batch, thread.run, max_batch=16)
        return await asyncio.gather(queue.submit(request("bad"), None), queue.submit(request("good"), None),
                                    return_exceptions=True)

    bad, good = asyncio.run(scenario())
    assert isinstance(bad, ValueError) and good == "ok"


# ---- long prompts on a node: a token budget per step --------------------------------------------------------


def test_a_long_prompt_runs_in_chunks_with_a_decode_step_between_and_ends_as_one_prefill(built_in):
    """With a budget of 16 tokens a step, a 60-token prefill runs in 4 chunks; a decode step of another session
    arriving after it finishes first (it waits one chunk, not the prompt), and the prefill ends with the token
    and the session length of the same prompt prefilled whole (a chunked prefill is within float rounding)."""
    from daemon import wire
    from daemon.model.service import ShardService
    from daemon.model.tensors import to_activation

    shard = built_in
    prompt = (PROMPTS[0] + PROMPTS[2] + PROMPTS[1] + PROMPTS[0] + PROMPTS[2] + PROMPTS[2])[:60]
    assert len(prompt) == 60
    whole = shard.step(shard.embed(prompt), mode="prefill", session_id="whole", past_len=0, start_layer=0,
                       sampling=GREEDY).token_id
    first = shard.step(shard.embed(PROMPTS[1]), mode="prefill", session_id="decoding", past_len=0, start_layer=0,
                       sampling=GREEDY).token_id
    service = ShardService(shard, shard.sessions, threads=2, share_cores=False, kv_cache=True, max_batch=16,
                           step_tokens=16)

    def forward(hidden, *, mode, session, past_len):
        return wire.ForwardRequest(activation=to_activation(hidden), mode=mode, session_id=session,
                                   past_len=past_len, start_layer=0, hop_index=0)

    async def scenario():
        finished = []

        async def run(name, request):
            reply = await service.forward(request)
            finished.append(name)
            return reply

        long = asyncio.ensure_future(run("prefill", forward(shard.embed(prompt), mode="prefill", session="long",
                                                            past_len=0)))
        await asyncio.sleep(0.05)  # the prefill's first chunk is running
        decode = asyncio.ensure_future(run("decode", forward(shard.embed([first]), mode="decode",
                                                             session="decoding", past_len=len(PROMPTS[1]))))
        replies = await asyncio.gather(long, decode)
        return finished, replies

    try:
        finished, (long_reply, decode_reply) = asyncio.run(scenario())
    finally:
        service.close()
    assert finished == ["decode", "prefill"]
    assert long_reply.token_id == whole
    assert shard.sessions.checkout("long", past_len=60, start_layer=0).past_len == 60
    assert decode_reply.token_id is not None
    assert service.queue.batches >= 5  # four chunks and the decode step


def test_a_planned_bfloat16_batch_attends_as_its_sessions_single_steps(tiny_model, monkeypatch):
    """Where single bfloat16 steps attend in float32 (a planned node), each row of a batch does too."""
    from daemon.model import decode

    shard = ModelShard(tiny_model("llama"), 0, 4, kv_cache=True, sessions=store(), dtype=torch.bfloat16)
    shard.native_steps = True
    shard.forget_fast_decoder()
    rows = []
    real = decode.attend_in_float32
    monkeypatch.setattr(decode, "attend_in_float32", lambda q, *a, **k: rows.append(q.shape[2]) or real(q, *a, **k))
    together, batched_logits = run_together(shard, PROMPTS, 4)
    assert rows and set(rows) == {1}  # one query at a time, in the batch
    for i, prompt in enumerate(PROMPTS):
        alone, logits = run_alone(shard, prompt, 4, f"alone{i}")
        for step, single in enumerate(logits):
            scale = single.float().abs().max().item()
            assert (batched_logits[step][i].float() - single.float()).abs().max().item() <= 0.05 * scale
