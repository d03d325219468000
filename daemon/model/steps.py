"""The steps waiting at a node, taken off in the order they came, decode steps together.

A node computes one forward at a time on its torch thread. Steps that arrive while
it computes wait here; when the thread is free, the oldest waiting step decides
what runs next:

- a one-position decode step runs together with every other decode step waiting
  for the same start layer (up to ``max_batch``): one forward for all of them
  (continuous batching: sessions join and leave at any step);
- anything else (a prefill, a prompt extending a session, a stateless step) runs
  alone. It waits at most for the batch ahead of it, and the decode steps that came
  after it wait at most for it. A prompt longer than the node's token budget per
  step runs a budget's worth at a time, queueing again behind the steps that came
  meanwhile (:data:`AGAIN`): running decodes wait one chunk at most, not a prompt.

A step of a lone session arriving at an idle node runs at once. Where several sessions
decode here, the first of their steps to arrive at an idle node waits for the others
as long as they keep coming (``COALESCE_SECONDS`` after the latest), so one batch's
replies coming back from the next node one after another do not split into smaller
batches.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from daemon import wire
from daemon.model.shard import StepResult

ACTIVE_SECONDS = 1.0  # a session whose decode step came here this recently is expected back
# how long a decode step arriving at an idle node waits for the steps of the other sessions decoding here, counted
# from the latest arrival: the replies of one batch on the next node come back one after another (on the head, each
# through its generation loop: about 0.5 ms a session), and would otherwise split into small batches
COALESCE_SECONDS = 0.002
# ... and while another daemon on this host computes (the other steps are likely there): the cores are busy
# anyway, so waiting costs nothing, and the sessions merge into one batch instead of two half-size ones
COALESCE_WHILE_OTHERS_COMPUTE_SECONDS = 0.25


@dataclass
class Job:
    """One ``/forward`` step waiting for the torch thread, and the future its handler awaits."""

    request: wire.ForwardRequest
    token_ids: list[int] | None  # the head's own first hop: embedded on the torch thread
    future: asyncio.Future
    queued: float = field(default_factory=time.monotonic)
    progress: object = None  # what the runner keeps between the parts of a job that runs in several
    then: Callable | None = None  # on the torch thread after the step, with its outcome: runs alone, unbatched

    @property
    def batchable(self) -> bool:
        """A one-position decode step: of a running session, or the first of one starting from a held prefix (the
        last token of a prompt the node already holds, which is how concurrent clients of one prompt begin)."""
        r = self.request
        return r.mode == "decode" and r.activation.shape[1] == 1 and self.then is None


AGAIN = object()  # an outcome: the job ran a part of itself (a long prompt's chunk) and queues again for the rest

BatchRunner = Callable[[list[Job]], list]  # on the torch thread: an outcome (result, exception, AGAIN) per job


class StepQueue:
    """Waiting steps, run as batches through ``run_batch`` on ``executor`` (the node's one torch thread).

    ``on_batch(size, waits)`` is told each batch's size and its steps' seconds in the queue.
    """

    def __init__(self, run_batch: BatchRunner, run: Callable, *, max_batch: int,
                 on_batch: Callable[[int, list[float]], None] | None = None,
                 others_computing: Callable[[], int] | None = None) -> None:
        self._run_batch = run_batch
        self._run = run  # awaits a function on the torch thread
        self.max_batch = max_batch
        self._on_batch = on_batch
        self._others_computing = others_computing  # other daemons on this host computing now, where known
        self._waiting: deque[Job] = deque()
        self._draining = False
        self._seen: dict[str, float] = {}  # session -> when its last decode step arrived
        self._arrived = asyncio.Event()
        self._drainer: asyncio.Task | None = None  # held: the loop keeps only a weak reference to a task
        self.batches = 0

    async def submit(self, request: wire.ForwardRequest, token_ids: list[int] | None, then: Callable | None = None):
        """Queue one step and wait for its outcome (raised if it failed); ``then`` see :class:`Job`."""
        job = Job(request, token_ids, asyncio.get_running_loop().create_future(), then=then)
        self._waiting.append(job)
        if job.batchable:
            self._seen[request.session_id] = job.queued
            self._arrived.set()
        if not self._draining:
            self._draining = True
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        return await job.future

    async def _drain(self) -> None:
        try:
            await self._gather()
            while self._waiting:
                jobs = self._next()
                if not jobs:
                    continue
                started = time.monotonic()
                try:
                    outcomes = await self._run(self._run_batch, jobs)
                except Exception as exc:  # noqa: BLE001 - the executor itself failed (shut down)
                    outcomes = [exc] * len(jobs)
                self.batches += 1
                if self._on_batch is not None:
                    self._on_batch(len(jobs), [started - job.queued for job in jobs])
                for job, outcome in zip(jobs, outcomes):
                    if job.future.done():  # its client went away meanwhile
                        continue
                    if outcome is AGAIN:  # behind the steps that came meanwhile: they wait one part at most
                        job.queued = time.monotonic()
                        self._waiting.append(job)
                    elif isinstance(outcome, BaseException):
                        job.future.set_exception(outcome)
                    else:
                        job.future.set_result(outcome)
        finally:
            self._draining = False

    def forget(self, session_id: str) -> None:
        """A session ended (dropped, or kept only as a prefix): no step of it is expected any more."""
        self._seen.pop(session_id, None)

    def active_sessions(self) -> int:
        """Sessions whose decode steps came here in the last ``ACTIVE_SECONDS``."""
        horizon = time.monotonic() - ACTIVE_SECONDS
        for session in [s for s, seen in self._seen.items() if seen < horizon]:
            del self._seen[session]
        return len(self._seen)

    async def _gather(self) -> None:
        """From idle, before the first batch: where other sessions decode here too, wait for their steps to
        arrive while they keep coming, until ``COALESCE_SECONDS`` pass without one, or longer while another
        daemon on this host computes (``COALESCE_WHILE_OTHERS_COMPUTE_SECONDS`` from the first at most). A lone
        session's step starts at once."""
        if self.max_batch <= 1 or not self._waiting or not self._waiting[0].batchable:
            return
        expected = min(self.active_sessions(), self.max_batch)
        loop = asyncio.get_running_loop()
        started = last = loop.time()
        arrived = len(self._waiting)
        while arrived < expected:
            now = loop.time()
            if now - started >= COALESCE_WHILE_OTHERS_COMPUTE_SECONDS:
                return
            quiet = now - last
            if quiet >= COALESCE_SECONDS and not (self._others_computing is not None and self._others_computing()):
                return
            self._arrived.clear()
            try:  # woken by each arrival; re-checks whether others still compute every COALESCE_SECONDS
                await asyncio.wait_for(self._arrived.wait(),
                                       COALESCE_SECONDS - quiet if quiet < COALESCE_SECONDS else COALESCE_SECONDS)
            except TimeoutError:
                pass
            if len(self._waiting) > arrived:  # the steps of one batch's replies come in one after another
                arrived, last = len(self._waiting), loop.time()

    def _next(self) -> list[Job]:
        """The steps to run next: the oldest, with the decode steps it can batch with."""
        first = self._waiting.popleft()
        if first.future.done():  # cancelled while it waited: its handler is gone
            return []
        if not first.batchable or self.max_batch <= 1:
            return [first]
        batch, rest = [first], deque()
        sessions, prefixes = {first.request.session_id}, {first.request.prefix} - {None}
        while self._waiting and len(batch) < self.max_batch:
            job = self._waiting.popleft()
            r = job.request
            if job.future.done():
                continue
            # a batch makes its sessions from their prefixes before it runs: none may start from a session the
            # batch steps (or be one another starts from); several may copy one prefix
            if (job.batchable and r.start_layer == first.request.start_layer
                    and r.session_id not in sessions and r.session_id not in prefixes and r.prefix not in sessions):
                batch.append(job)
                sessions.add(r.session_id)
                if r.prefix is not None:
                    prefixes.add(r.prefix)
            else:
                rest.append(job)
        rest.extend(self._waiting)
        self._waiting = rest
        return batch


@dataclass
class Computed:
    """A step's outcome on the torch thread: ``seconds`` its forward took (its batch's), ``share`` its part."""

    result: StepResult
    out: wire.Activation | None
    seconds: float
    share: float
    then: object = None  # what the job's ``then`` answered (the head's walk of the rest of its route)


@dataclass
class Chunks:
    """A long prompt's way through the node, a token budget per turn of the queue."""

    hidden: torch.Tensor  # the whole step's input
    done: int = 0  # positions computed so far
    parts: list[torch.Tensor] = field(default_factory=list)  # their outputs (none on the tail)
    seconds: float = 0.0
    restarts: int = 0

    def restart(self) -> None:
        self.done, self.restarts = 0, self.restarts + 1
        self.parts.clear()
