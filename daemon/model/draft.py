"""A draft model on the head (``--draft-model``): a small model of the target's family, in the head's own
process, that proposes the next few tokens greedily for speculative decoding (:mod:`daemon.mesh.speculation`).

It is a whole-model :class:`~daemon.model.shard.ModelShard` (so it takes the same dtypes, ``--draft-quantize
int8`` and native kernels as a node), run on the head's torch thread between the generation's steps. Each
generation keeps its own cache of what the draft model has seen; when the tail rejects a draft, the cache is
cut back to the tokens both agree on and continues from there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from daemon.errors import ModelUnavailable
from daemon.model.kvcache import cut_back
from daemon.model.shard import ModelShard

RunOnTorchThread = Callable[..., Awaitable]


class DraftModel:
    """``--draft-model``: drafts tokens with a whole small model; a :class:`DraftSession` per generation."""

    def __init__(self, shard: ModelShard, run: RunOnTorchThread, *, name: str) -> None:
        self.shard = shard
        self.name = name
        self._run = run

    @classmethod
    def load(cls, folder: Path, run: RunOnTorchThread, *, dtype: torch.dtype, quantize: str | None,
             tune_kernels: bool) -> DraftModel:
        """Load (blocking; on the torch thread ``run`` uses) every layer of the model in ``folder``."""
        shard = ModelShard(folder, 0, _layer_count(folder), head=True, kv_cache=True, sessions=None,
                           dtype=dtype, quantize=quantize)
        if tune_kernels:
            from daemon.model.kernels import default_store

            shard.plan_kernels(max_rows=1, store=default_store())
        return cls(shard, run, name=shard.info.name)

    def check_tokenizer(self, target) -> None:
        """Refuse a draft model whose tokenizer is not the target's (``target``: the head's ChatTokenizer)."""
        if self.shard.tokenizer.vocabulary() != target.vocabulary():
            raise ModelUnavailable(f"--draft-model {self.name} has another tokenizer than the served model; a draft "
                                   "must share the target's vocabulary (pick a model of the same family)")

    def session(self) -> DraftSession:
        return DraftSession(self)

    async def run(self, fn, *args):
        return await self._run(fn, *args)


class DraftSession:
    """One generation's draft state: the cache of the tokens the draft model has seen (``held``)."""

    def __init__(self, model: DraftModel) -> None:
        self.model = model
        self.cache = None
        self.held: list[int] = []

    async def propose(self, ids: list[int], k: int) -> list[int]:
        return await self.model.run(self._propose, ids, k)

    def close(self) -> None:
        self.cache, self.held = None, []

    @torch.inference_mode()
    def _propose(self, ids: list[int], k: int) -> list[int]:
        """``k`` greedy tokens to follow ``ids`` (fewer where the draft model's context ends)."""
        shard = self.model.shard
        k = min(k, shard.context_length - len(ids))
        if k <= 0:
            return []
        common = _common_prefix(self.held, ids, limit=len(ids) - 1)  # the last token is fed again for its logits
        if common and common < len(self.held):
            if cut_back(self.cache, common, len(self.held), copy=False) is None:
                common = 0  # layers that cannot be cut back (linear attention): from the start
        if not common:
            self.cache = shard.new_cache()
        feed, past, drafts = ids[common:], common, []
        for _ in range(k):
            out = shard.run_as_steps(shard.embed(feed), start_layer=0, past_len=past, cache=self.cache, exact=False)
            past += len(feed)
            token = int(torch.argmax(shard.logits_last(out)))
            drafts.append(token)
            feed = [token]
        self.held = ids + drafts[:-1]  # the last draft was never fed
        return drafts


def _common_prefix(a: list[int], b: list[int], *, limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n


def _layer_count(folder: Path) -> int:
    from daemon.model.checkpoint import read_model_info

    return read_model_info(folder).num_layers
