"""The head's decode steps for one node, gathered into one ``POST /forward/batch`` (:mod:`daemon.server.batch`).

A head running several generations sends each node one step per generation per token. The replies of one batch
come back together, so the generations' next steps for a node are ready in the same turn of the event loop: the
steps that arrive in a turn wait for its end and leave as one request of request frames (:mod:`daemon.channel`).
The node answers with one reply frame per step, and each step reads its own as it would ``POST /forward``'s
answer. A lone step goes on ``POST /forward`` as before.

A node that does not know the path (an older meshd: 404 or 405) is sent each step alone, and asked again after
:data:`RETRY_SECONDS`. A batch the node refuses whole (a 401, a 413, a 5xx) is that refusal for each of its steps.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from daemon import channel, wire
from daemon.errors import UpstreamError
from daemon.mesh.transport import HopResponse

ENV = "MESHNET_BATCH_HOPS"  # "off": every step goes on its own POST /forward (to measure what batches do)
RETRY_SECONDS = 60.0  # a node that did not know POST /forward/batch is sent a batch again after this

# sends one request: (url, headers, body, seconds) -> the answer
Post = Callable[[str, Mapping[str, str], bytes, float], Awaitable[HopResponse]]


def batch_hops_enabled() -> bool:
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "false", "no")


@dataclass
class _Step:
    headers: Mapping[str, str]
    body: bytes
    seconds: float
    answer: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class HopBatches:
    """Gathers the steps ready for each node in one turn of the loop and sends them together with ``post``."""

    def __init__(self, post: Post) -> None:
        self._post = post
        self._gathering: dict[str, list[_Step]] = {}  # node URL -> the steps that arrived this turn
        self._unknown: dict[str, float] = {}  # node URL -> when it answered that it has no batch path
        self._sending: set[asyncio.Task] = set()  # held: the loop keeps only a weak reference to a task
        # whether other steps may come in the same turn (the head runs several generations): a lone generation's
        # steps go at once, not a turn later
        self.wanted: Callable[[], bool] = lambda: True

    def takes(self, url: str) -> bool:
        """Whether a step for ``url`` goes through a batch: others may come with it, and the node did not answer
        lately that it has no batch path."""
        since = self._unknown.get(url)
        return self.wanted() and (since is None or time.monotonic() - since > RETRY_SECONDS)

    async def send(self, url: str, headers: Mapping[str, str], body: bytes, seconds: float) -> HopResponse:
        """Send one step to ``url`` with the others for it that arrive in this turn of the loop; its answer, or
        what sending raised (``TimeoutError``, :class:`TransportError`, :class:`UpstreamError`)."""
        step = _Step(headers, body, seconds)
        gathering = self._gathering.get(url)
        if gathering is None:
            gathering = self._gathering[url] = []
            asyncio.get_running_loop().call_soon(self._leave, url)
        gathering.append(step)
        return await step.answer

    def _leave(self, url: str) -> None:
        steps = self._gathering.pop(url)
        task = asyncio.get_running_loop().create_task(self._deliver(url, steps))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _deliver(self, url: str, steps: list[_Step]) -> None:
        try:
            if len(steps) == 1:
                outcomes: list = [await self._post(url + "/forward", steps[0].headers, steps[0].body,
                                                   steps[0].seconds)]
            else:
                outcomes = await self._batch(url, steps)
        except asyncio.CancelledError:
            for step in steps:
                step.answer.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - the exchange failed: so did each of its steps
            outcomes = [exc] * len(steps)
        for step, outcome in zip(steps, outcomes):
            if step.answer.done():  # its generation ended meanwhile
                continue
            if isinstance(outcome, BaseException):
                step.answer.set_exception(outcome)
            else:
                step.answer.set_result(outcome)

    async def _batch(self, url: str, steps: list[_Step]) -> list:
        frames = [channel.request_frame(step.headers, step.body) for step in steps]
        body = b"".join(frames)
        seconds = max(step.seconds for step in steps)
        resp = await self._post(url + wire.BATCH_PATH, {"Content-Type": wire.BATCH_CONTENT_TYPE}, body, seconds)
        if resp.status in (404, 405):  # an older node: each step alone
            self._unknown[url] = time.monotonic()
            return await asyncio.gather(*(self._post(url + "/forward", step.headers, step.body, step.seconds)
                                          for step in steps), return_exceptions=True)
        if resp.status != 200:  # refused whole: the same refusal for each step
            return [resp] * len(steps)
        replies, problem = [], f"a {resp.content_type or 'typeless'} body"
        if resp.content_type == wire.BATCH_CONTENT_TYPE:
            try:
                replies = channel.replies_in(resp.body)
                problem = f"{len(replies)} answers to {len(steps)} steps"
            except channel.ChannelClosed as exc:
                problem = str(exc)
        if len(replies) != len(steps):
            return [UpstreamError(f"{url} answered a batch of steps with {problem}")] * len(steps)
        # each step's bytes: its own frame, and its share of the request's and the answer's HTTP heads
        sent_head = (resp.sent_bytes - len(body)) / len(steps)
        received_head = (resp.received_bytes - len(resp.body)) / len(steps)
        return [HopResponse(status, headers, bytes(reply), round(len(frame) + sent_head), round(size + received_head))
                for frame, (status, headers, reply, size) in zip(frames, replies)]
