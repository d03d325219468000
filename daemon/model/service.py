"""The node side of ``POST /forward``: a shard, its session store, and the one thread torch runs on.

Every piece of torch work runs on one dedicated worker thread, so the HTTP event loop answers
``/health`` and ``/v1/status`` in milliseconds while a step runs. The head's own layers run here
too (:meth:`ShardService.forward` with ``token_ids``): a local hop is the same step without HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from daemon import wire
from daemon.api import MemoryInfo, Sampling, SessionInfo
from daemon.errors import BadRequest, CacheMiss, NoRoom
from daemon.host import host_cores, large_allocations_mapped, proc_status_bytes
from daemon.kvstore import SessionCacheStore
from daemon.model.cores import CoreShare
from daemon.model.device import checkpoint_dtype, dtype_name, resolve_device, resolve_dtype
from daemon.model.migration import export_session, import_session, movable
from daemon.model.quantize import check_quantization
from daemon.model.shard import DecodeStep, ModelShard
from daemon.model.steps import AGAIN, Chunks, Computed, Job, StepQueue
from daemon.model.tensors import as_sent, to_activation, to_tensor
from daemon.model.tokenizer import ChatTokenizer
from daemon.model.worker import ChannelHandler, TorchThread

log = logging.getLogger(__name__)

MAX_CHUNK_RESTARTS = 2  # a prefill whose session is evicted between its chunks starts again at most this often

# after a walk the torch thread waits this long for the loop's next step with its team awake (a parked team's
# wake-up is slower); measured on a 2-core host, 2 ms against none: int4 two-node 0.81 against 0.79 of one node
LINGER_SECONDS = 0.002
BUSY_WINDOW_SECONDS = 10.0  # the share of time spent computing is reported over this window

StepObserver = Callable[[str | None, float], None]  # (mode, seconds) of every step run
_SETTLING: set[asyncio.Future] = set()  # sessions being cut back before they are retained: referenced until done


class ShardService:
    """A loaded shard serving steps on its own torch thread. Build with :meth:`load`.

    ``threads``: torch threads; with ``share_cores`` the count follows this host's core share
    (:class:`CoreShare`) before each step instead. ``on_step`` is told every step's mode and compute time.
    """

    def __init__(self, shard: ModelShard, store: SessionCacheStore, *, threads: int, share_cores: bool,
                 kv_cache: bool, on_step: StepObserver | None = None, max_batch: int = 1, step_tokens: int = 512,
                 on_batch: Callable[[int, list[float]], None] | None = None,
                 executor: TorchThread | None = None, runtime_rss_bytes: int | None = None) -> None:
        self.shard = shard
        self.runtime_rss_bytes = runtime_rss_bytes  # the process before its first weight was read
        self.store = store
        self.start, self.end = shard.start, shard.end
        self.info = shard.info
        self.hidden_size = shard.info.hidden_size
        self.vocab_size = shard.info.vocab_size
        self.context_length = shard.context_length
        self.chat_template: str | None = None  # --chat-template's text, used instead of the model's
        self.kv_cache_enabled = kv_cache  # as configured; whether the layers take a cache is the shard's
        self.fixed_threads = threads
        self.cores = _core_share() if share_cores else None
        self.on_step = on_step
        self.executor = executor or torch_thread()
        if self.cores is not None:  # park the OpenMP team between steps while another daemon shares the cores
            self.executor.park_when_idle = self.cores.shared
        # decode steps of sessions waiting here together run as one forward, where the layers allow it
        self.max_batch = max_batch if shard.batch_refusal is None else 1
        self.step_tokens = step_tokens  # a longer prompt runs in chunks of this many tokens
        self.queue = StepQueue(self._run_jobs, self.run, max_batch=self.max_batch, on_batch=on_batch,
                               others_computing=self.cores.others_computing if self.cores is not None else None)
        self.active_steps = 0
        self.steps_served = 0
        self.tokens_served = 0
        self.channel_steps = 0  # of steps_served, those a step channel brought (serve_now)
        self._compute_log: deque[tuple[float, float]] = deque()  # (finished, seconds) of recent steps
        self._accounting = threading.Lock()  # steps are counted on the event loop and on a step channel's thread

    @classmethod
    def load(cls, folder: Path, start: int, end: int, *, store: SessionCacheStore, kv_cache: bool, threads: int,
             share_cores: bool, dtype: str = "float32", device: str = "cpu", quantize: str | None = None,
             on_step: StepObserver | None = None, max_batch: int = 1, step_tokens: int = 512,
             on_batch: Callable[[int, list[float]], None] | None = None, tune_kernels: bool = False) -> ShardService:
        """Load layers ``[start, end)`` of the model in ``folder`` (blocking), in ``dtype`` on ``device``
        (``--dtype`` and ``--device`` values: ``auto`` resolves against this machine and the checkpoint), its
        layers' weights quantized with ``quantize`` if given (checked before any weight is read), and with
        ``tune_kernels`` its weights laid out and multiplied as they measure fastest here
        (:mod:`daemon.model.kernels`)."""
        where = resolve_device(device)
        compute = resolve_dtype(dtype, where, checkpoint_dtype(folder))
        if quantize:
            check_quantization(quantize, compute, where)

        runtime = proc_status_bytes("VmRSS")["VmRSS"]  # the process before its first weight is read

        def load() -> ModelShard:
            torch.set_num_threads(threads)
            shard = ModelShard(folder, start, end, head=start == 0, kv_cache=kv_cache, sessions=store,
                               dtype=compute, device=where, quantize=quantize)
            if tune_kernels:
                from daemon.model.kernels import default_store

                started = time.perf_counter()
                # timed on the threads the steps take when this node computes alone: one that shares the cores
                # loads on its share among the local peers, then takes them all for a single stream's steps
                torch.set_num_threads(host_cores() if share_cores else threads)
                try:  # timing kernels frees many samples and copies of 1-32 MiB: they leave the resident set at once
                    with large_allocations_mapped():
                        shard.plan_kernels(max_rows=max_batch if shard.batch_refusal is None else 1,
                                           store=default_store(), progress=log.info)
                finally:
                    torch.set_num_threads(threads)
                log.debug("kernel plans took %.2f s", time.perf_counter() - started)
            return shard

        executor = torch_thread()
        try:  # loading runs torch too: on the thread every step will run on, see torch_thread
            shard = executor.submit(load).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(shard, store, threads=threads, share_cores=share_cores, kv_cache=kv_cache, on_step=on_step,
                   max_batch=max_batch, step_tokens=step_tokens, on_batch=on_batch, executor=executor,
                   runtime_rss_bytes=runtime)

    @property
    def dtype(self) -> str:
        """The compute dtype, as the wire names it."""
        return dtype_name(self.shard.dtype)
    @property
    def supports_kv_cache(self) -> bool:
        return self.shard.supports_kv_cache

    @property
    def caches(self) -> bool:
        """Whether decode steps are served from a cache here: configured on and supported by the layers."""
        return self.kv_cache_enabled and self.shard.supports_kv_cache

    @property
    def threads(self) -> int:
        """Torch threads now: the core share once a step has set it, else the fixed count."""
        return (self.cores and self.cores.threads) or self.fixed_threads

    async def run(self, fn, *args):
        """Run torch work on the service's single worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.cores is not None:
            self.cores.close()

    # ---- one step ----------------------------------------------------------------------------

    async def forward(self, request: wire.ForwardRequest, *, token_ids: list[int] | None = None,
                      then: Callable[[Computed], object] | None = None) -> wire.ForwardReply:
        """One /forward step. ``token_ids``: the head's own first hop, embedded in the same worker call (one
        hand-off to the torch thread per step, not two); ``request.activation`` then only names dtype and shape.
        ``then(computed)``, on the torch thread right after the step (and outside its core share): the head's
        walk of the rest of a route over step channels; what it answers is the reply's ``then``."""
        with self._stepping(request):
            done: Computed = await self.queue.submit(request, token_ids, then)
        return self._reply(request, done)

    def serve_now(self, request: wire.ForwardRequest) -> wire.ForwardReply:
        """One step on the torch thread itself, as :meth:`forward` runs it: a step channel's (no hand-off)."""
        with self._stepping(request):
            [done] = self._run_jobs([Job(request, None, None)])
        if isinstance(done, Exception):
            raise done
        with self._accounting:
            self.channel_steps += 1
        return self._reply(request, done)

    def serve_channel(self, sock, handler: ChannelHandler) -> bool:
        """Serve a step channel's steps on the torch thread (:mod:`daemon.server.channel`)."""
        return self.executor.serve(sock, handler)

    @contextlib.contextmanager
    def _stepping(self, request: wire.ForwardRequest):
        """Around a step: its checks before any work, and its count among the active ones."""
        positions = request.past_len + request.activation.shape[1]
        if positions > self.context_length:
            raise BadRequest(f"the step reaches position {positions}; the model's context is {self.context_length}",
                             param=wire.SHAPE)
        if request.mode == "prefill":  # once per generation (and re-prefill) per node: never per token
            log.info("session %s: prefill of %d tokens from layer %d", request.session_id,
                     request.activation.shape[1], request.start_layer)
        elif request.prefix is not None:  # a prompt starting from a held prefix: once per generation too
            log.info("session %s: %s %d tokens of session %s, then %d new, from layer %d", request.session_id,
                     "takes" if request.take_prefix else "copies", request.past_len, request.prefix,
                     request.activation.shape[1], request.start_layer)
        with self._accounting:
            self.active_steps += 1
        try:
            yield
        finally:
            with self._accounting:
                self.active_steps -= 1

    def _reply(self, request: wire.ForwardRequest, done: Computed) -> wire.ForwardReply:
        """Count a step that ran (from either thread) and make its reply."""
        with self._accounting:
            self.steps_served += 1
            self.tokens_served += request.activation.shape[1]
            self._compute_log.append((time.monotonic(), done.share))
        if self.on_step is not None:
            self.on_step(request.mode, done.seconds)
        compute_ms = done.seconds * 1000.0
        if done.out is not None:
            return wire.ForwardReply(activation=done.out, compute_ms=compute_ms, then=done.then)
        result = done.result
        tokens = None if result.tokens is None else [
            wire.TokenChoice(t.token_id, t.text, t.logprob, t.top_logprobs) for t in result.tokens]
        return wire.ForwardReply(token_id=result.token_id, text=result.text, compute_ms=compute_ms,
                                 logprob=result.logprob, top_logprobs=result.top_logprobs, tokens=tokens,
                                 then=done.then)

    def _run_jobs(self, jobs: list[Job]) -> list[Computed | Exception]:
        """A batch the queue took, on the torch thread: each job's outcome, a failure its own."""
        with self.cores.computing() if self.cores is not None else contextlib.nullcontext():
            if len(jobs) != 1:
                return self._compute_batch(jobs)
            job = jobs[0]
            try:
                if self._in_chunks(job.request):
                    return [self._compute_chunk(job)]
                done = self._compute(job.request, job.token_ids)
            except Exception as exc:  # noqa: BLE001 - raised to the step's own handler
                return [exc]
        if job.then is not None:  # the cores are given back while the rest of the route computes
            done.then = job.then(done)
            self.executor.linger(LINGER_SECONDS)  # the generation loop sends its next step at once
        return [done]

    def _hidden(self, request: wire.ForwardRequest, token_ids: list[int] | None) -> torch.Tensor:
        """A step's hidden states, from the request's bytes or embedded here."""
        if token_ids is None:
            return to_tensor(request.activation, compute_dtype=self.shard.dtype, device=self.shard.device)
        # rounded as the wire would have rounded it, so a local first hop changes nothing
        return as_sent(self.shard.embed(token_ids), wire_dtype=request.activation.dtype,
                       compute_dtype=self.shard.dtype)

    def _compute(self, request: wire.ForwardRequest, token_ids: list[int] | None) -> Computed:
        """One step alone."""
        started = time.perf_counter()
        result = self.shard.step(
            self._hidden(request, token_ids),
            mode=request.mode,
            session_id=request.session_id,
            past_len=request.past_len,
            start_layer=request.start_layer,
            sampling=Sampling(**request.sampling),
            prefix=request.prefix,
            take_prefix=request.take_prefix,
            history=request.history,
            draft=request.draft,
        )
        seconds = time.perf_counter() - started
        # the reply travels in the dtype the request came in, serialised here rather than on the event loop
        out = to_activation(result.hidden, dtype=request.activation.dtype) if result.hidden is not None else None
        return Computed(result, out, seconds, seconds)

    def _in_chunks(self, request: wire.ForwardRequest) -> bool:
        """Whether a step is a prompt longer than a step's token budget, on a node keeping its session."""
        return (request.mode in ("prefill", "decode") and self.shard.sessions is not None
                and request.activation.shape[1] > self.step_tokens and request.draft is None)

    def _compute_chunk(self, job: Job) -> Computed | object:
        """The next ``step_tokens`` of a long prompt: :data:`AGAIN` until the last, then the whole step's outcome
        (the hidden states of every position, or the tail's token)."""
        r = job.request
        chunks: Chunks = job.progress or Chunks(self._hidden(r, job.token_ids))
        job.progress = chunks
        started = time.perf_counter()
        first = chunks.done == 0
        base = 0 if r.mode == "prefill" else r.past_len  # an extended session starts where it was
        part = chunks.hidden[:, chunks.done:chunks.done + self.step_tokens]
        try:
            result = self.shard.step(part, mode=r.mode if first else "decode", session_id=r.session_id,
                                     past_len=base + chunks.done, start_layer=r.start_layer,
                                     sampling=Sampling(**r.sampling), prefix=r.prefix if first else None,
                                     take_prefix=r.take_prefix and first, history=r.history)
        except CacheMiss:
            # evicted between two chunks of a prefill: the prompt from its start, here, rather than a failed step
            if first or r.mode != "prefill" or chunks.restarts >= MAX_CHUNK_RESTARTS:
                raise
            chunks.restart()
            return AGAIN
        chunks.seconds += time.perf_counter() - started
        chunks.done += part.shape[1]
        if result.hidden is not None:
            chunks.parts.append(result.hidden)
        if chunks.done < chunks.hidden.shape[1]:
            return AGAIN
        out = to_activation(torch.cat(chunks.parts, dim=1), dtype=r.activation.dtype) if chunks.parts else None
        return Computed(result, out, chunks.seconds, chunks.seconds)

    def _compute_batch(self, jobs: list[Job]) -> list[Computed | Exception]:
        """Decode steps of several sessions as one forward (``ModelShard.step_batch``)."""
        started = time.perf_counter()
        outcomes: list[Computed | Exception | None] = [None] * len(jobs)
        steps, rows = [], []
        for i, job in enumerate(jobs):
            r = job.request
            try:
                steps.append(DecodeStep(self._hidden(r, job.token_ids), r.session_id, r.past_len,
                                        Sampling(**r.sampling), r.history, r.prefix, r.take_prefix))
                rows.append(i)
            except Exception as exc:  # noqa: BLE001 - that step's own error
                outcomes[i] = exc
        results = self.shard.step_batch(steps, start_layer=jobs[0].request.start_layer) if steps else []
        seconds = time.perf_counter() - started
        for i, result in zip(rows, results):
            if isinstance(result, Exception):
                outcomes[i] = result
                continue
            dtype = jobs[i].request.activation.dtype
            out = to_activation(result.hidden, dtype=dtype) if result.hidden is not None else None
            outcomes[i] = Computed(result, out, seconds, seconds / len(jobs))
        return outcomes

    def busy(self) -> float:
        """The share of the last few seconds this node spent computing steps, 0..1: its load."""
        horizon = time.monotonic() - BUSY_WINDOW_SECONDS
        with self._accounting:
            while self._compute_log and self._compute_log[0][0] < horizon:
                self._compute_log.popleft()
            return min(1.0, sum(seconds for _, seconds in self._compute_log) / BUSY_WINDOW_SECONDS)

    # ---- what the head's own layers add ----------------------------------------------------------

    async def ensure_head(self) -> ChatTokenizer:
        """The embeddings and tokenizer, loaded on first use as head."""
        if not self.shard.is_head_loaded:
            await self.run(self.shard.ensure_head)
        tokenizer = self.shard.tokenizer
        if self.chat_template is not None:  # a head shard loads its tokenizer with its weights: set it here
            tokenizer.use_chat_template(self.chat_template)
        return tokenizer

    async def embed(self, token_ids: list[int], *, dtype: str) -> wire.Activation:
        return await self.run(lambda: to_activation(self.shard.embed(token_ids), dtype=dtype))

    # ---- what the node reports ----------------------------------------------------------------

    def memory(self) -> MemoryInfo:
        """This process's peak and current resident memory and what it held before its weights, and the
        device's peak where it has its own."""
        device = self.shard.device
        device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        # one reading: the kernel gives both at one instant, the peak never under the resident set (two readings
        # could see the set grow between them, past the peak read first)
        rss = proc_status_bytes("VmHWM", "VmRSS")
        return MemoryInfo(peak_rss_bytes=rss["VmHWM"], rss_bytes=rss["VmRSS"],
                          device_peak_bytes=device_peak, runtime_rss_bytes=self.runtime_rss_bytes)

    # ---- sessions ----------------------------------------------------------------------------

    def sessions(self) -> list[SessionInfo]:
        return [SessionInfo(e.session_id, e.past_len, e.start_layer, e.nbytes, e.created_at, e.last_used, e.expires_at,
                            retained=e.retained)
                for e in self.store.entries()]

    def drop_session(self, session_id: str) -> bool:
        self.queue.forget(session_id)
        return self.store.drop(session_id)

    def retain_session(self, session_id: str, past_len: int | None = None) -> bool:
        """Keep a finished generation's session as a prefix later requests can start from; ``past_len``: the
        positions its generation kept, which a session ending in a verify step is first cut back to (on the torch
        thread, ahead of any later step; see :meth:`ModelShard.settle`)."""
        self.queue.forget(session_id)  # its generation ended: no more steps of it
        entry = self.store.get(session_id)
        if entry is None:
            return False
        if past_len is not None and entry.past_len != past_len and entry.can_rewind_to(past_len):
            settling = asyncio.get_running_loop().run_in_executor(self.executor, self.shard.settle, session_id,
                                                                  past_len)
            settling.add_done_callback(lambda done: done.exception() is None and self.store.retain(session_id))
            _SETTLING.add(settling)
            settling.add_done_callback(_SETTLING.discard)
            return True
        return self.store.retain(session_id)

    # ---- sessions moving between nodes (a drain) ----------------------------------------------

    async def export_session(self, session_id: str) -> bytes | None:
        """A live session's cache as bytes for a node taking this one's layers over (on the torch thread, between
        steps); None where it is gone or cannot move (:mod:`daemon.model.migration`)."""
        def export() -> bytes | None:
            entry = self.store.get(session_id)
            if entry is None or entry.retained or not movable(self.shard, entry):
                return None
            return export_session(self.shard, entry)

        return await self.run(export)

    async def import_session(self, session_id: str, data: bytes) -> SessionInfo:
        """Take over a session another node sent: checked whole before it is stored (a refusal stores nothing)."""
        if not self.caches:
            raise BadRequest("this node keeps no session caches (--no-kv-cache, or its layers take none)")
        imported = await self.run(import_session, self.shard, data)
        self.store.put(session_id, imported.cache, past_len=imported.past_len, start_layer=imported.start_layer,
                       nbytes=imported.nbytes)
        if imported.undo is not None:  # a verify step's rejected drafts may still be cut off, as on the sender
            self.store.commit(session_id, past_len=imported.past_len, nbytes=imported.nbytes, undo=imported.undo,
                              rewind_from=imported.rewind_from)
        entry = self.store.get(session_id)
        if entry is None:
            raise NoRoom(f"a session of {imported.nbytes} bytes does not fit this node's session cache "
                         "(--kv-max-bytes, --kv-max-sessions)")
        log.info("session %s: taken over, %d positions from layer %d", session_id, entry.past_len,
                 entry.start_layer)
        return SessionInfo(entry.session_id, entry.past_len, entry.start_layer, entry.nbytes, entry.created_at,
                           entry.last_used, entry.expires_at)


def torch_thread() -> TorchThread:
    """The one OS thread a node runs torch on: loading, every step, embedding (see :mod:`daemon.model.worker`)."""
    return TorchThread("torch")


def _core_share() -> CoreShare | None:
    try:
        return CoreShare()
    except OSError as exc:  # no shared folder to meet the other daemons in: keep the fixed thread count
        log.warning("cannot share cores with the other daemons on this host (%s); threads stay fixed", exc)
        return None
