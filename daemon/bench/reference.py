"""The limit the mesh is measured against: the whole model in one process, transformers' own ``generate``."""

from __future__ import annotations

import time
from pathlib import Path

from daemon.bench.progress import Progress

# what every setup generates from, the mesh's as well as this one
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def prompt_ids(folder: Path) -> list[int]:
    """:data:`PROMPT` as the model's chat template renders it, ready for the assistant's answer: the token ids
    every setup starts from (llama.cpp gets these ids too, not text of its own tokenizing)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).apply_chat_template(PROMPT, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class Reference:
    """The whole model in this process, generating with ``model.generate``: the limit of the mesh."""

    def __init__(self, folder: Path, dtype: str = "float32", quantize: str | None = None, *,
                 device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
        if quantize:  # as the nodes quantize their layers and the tail its LM head
            from daemon.model.quantize import quantize_model

            quantize_model(self.model, quantize)
        self.ids = torch.tensor([prompt_ids(folder)], device=device)
        self._generate(4, None)  # warm-up

    def _generate(self, tokens: int, progress: Progress | None) -> tuple[list[int], list[float]]:
        import torch

        times: list[float] = []
        prompt_seen = False

        class Clock:  # a streamer: generate hands it each new token the moment it exists
            def put(self, value) -> None:
                nonlocal prompt_seen
                if not prompt_seen:  # the first call carries the prompt
                    prompt_seen = True
                    return
                times.append(time.perf_counter())
                if progress is not None:
                    progress.step()

            def end(self) -> None:
                pass

        started = time.perf_counter()
        with torch.inference_mode():
            # no EOS: exactly ``tokens`` new tokens, as the mesh's ignore_eos generates them
            out = self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids), max_new_tokens=tokens,
                                      do_sample=False, eos_token_id=None, streamer=Clock())
        return out[0, self.ids.shape[1]:].tolist(), [started, *times]

    def run(self, tokens: int, threads: int) -> dict:
        import torch

        torch.set_num_threads(threads)
        progress = Progress(f"generate in {self.model.dtype}, {threads} thread(s), {tokens} tokens", tokens)
        token_ids, times = self._generate(tokens, progress)
        progress.end()
        step_ms = [(b - a) * 1000.0 for a, b in zip(times[1:], times[2:])]
        decode_s = times[-1] - times[1]
        return {
            "prefill_ms": (times[1] - times[0]) * 1000.0,
            "decode_tps": (len(token_ids) - 1) / decode_s if decode_s > 0 else None,
            "step_ms": step_ms,
            "token_ids": token_ids,
        }
