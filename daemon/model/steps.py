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

Nothing waits for a timer: a step arriving at an idle node runs after the event loop's next
few turns, with whatever arrived in them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from daemon import wire

log = logging.getLogger(__name__)

IDLE_YIELDS = 3  # event-loop turns a step arriving at an idle node waits for others arriving with it


@dataclass
class Job:
    """One ``/forward`` step waiting for the torch thread, and the future its handler awaits."""

    request: wire.ForwardRequest
    token_ids: list[int] | None  # the head's own first hop: embedded on the torch thread
    future: asyncio.Future
    queued: float = field(default_factory=time.monotonic)
    progress: object = None  # what the runner keeps between the parts of a job that runs in several

    @property
    def batchable(self) -> bool:
        r = self.request
        return r.mode == "decode" and r.prefix is None and r.activation.shape[1] == 1


AGAIN = object()  # an outcome: the job ran a part of itself (a long prompt's chunk) and queues again for the rest

BatchRunner = Callable[[list[Job]], list]  # on the torch thread: an outcome (result, exception, AGAIN) per job


class StepQueue:
    """Waiting steps, run as batches through ``run_batch`` on ``executor`` (the node's one torch thread).

    ``on_batch(size, waits)`` is told each batch's size and its steps' seconds in the queue.
    """

    def __init__(self, run_batch: BatchRunner, run: Callable, *, max_batch: int,
                 on_batch: Callable[[int, list[float]], None] | None = None) -> None:
        self._run_batch = run_batch
        self._run = run  # awaits a function on the torch thread
        self.max_batch = max_batch
        self._on_batch = on_batch
        self._waiting: deque[Job] = deque()
        self._draining = False
        self.batches = 0
        self.batched_steps = 0  # steps that ran in a batch of two or more

    def __len__(self) -> int:
        return len(self._waiting)

    async def submit(self, request: wire.ForwardRequest, token_ids: list[int] | None):
        """Queue one step and wait for its outcome (raised if it failed)."""
        job = Job(request, token_ids, asyncio.get_running_loop().create_future())
        self._waiting.append(job)
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await job.future

    async def _drain(self) -> None:
        try:
            # from idle: let the loop hand over what arrived with this step (the replies of one batch on the
            # next node come back together) before taking the first batch; a few microseconds when nothing did
            for _ in range(IDLE_YIELDS):
                await asyncio.sleep(0)
            while self._waiting:
                jobs = self._next()
                if not jobs:
                    continue
                started = time.monotonic()
                try:
                    outcomes = await self._run(self._run_batch, jobs)
                except BaseException as exc:  # noqa: BLE001 - the executor itself failed (shut down)
                    outcomes = [exc] * len(jobs)
                self.batches += 1
                if len(jobs) > 1:
                    self.batched_steps += len(jobs)
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

    def _next(self) -> list[Job]:
        """The steps to run next: the oldest, with the decode steps it can batch with."""
        first = self._waiting.popleft()
        if first.future.done():  # cancelled while it waited: its handler is gone
            return []
        if not first.batchable or self.max_batch <= 1:
            return [first]
        batch, rest = [first], deque()
        sessions = {first.request.session_id}
        while self._waiting and len(batch) < self.max_batch:
            job = self._waiting.popleft()
            r = job.request
            if job.future.done():
                continue
            if job.batchable and r.start_layer == first.request.start_layer and r.session_id not in sessions:
                batch.append(job)
                sessions.add(r.session_id)
            else:
                rest.append(job)
        rest.extend(self._waiting)
        self._waiting = rest
        return batch
