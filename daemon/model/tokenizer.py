"""The model's tokenizer and generation config: prompts to token ids, ids to text, and when to stop."""

from __future__ import annotations

import json
from pathlib import Path

from daemon.errors import BadRequest, ModelUnavailable


class ChatTokenizer:
    """What the head needs to turn a chat into token ids and back, and the tail to name its token."""

    def __init__(self, tokenizer, *, config, generation: dict) -> None:
        self._tokenizer = tokenizer
        self._generation = generation
        ids: set[int] = set()
        for c in (getattr(config, "eos_token_id", None), generation.get("eos_token_id"), tokenizer.eos_token_id):
            ids.update(c if isinstance(c, list) else [c] if c is not None else [])
        self.eos_token_ids: set[int] = ids
        self.eos_texts: set[str] = {tokenizer.decode([i]) for i in ids}  # for an older tail that answers text only
        self._texts: dict[int, str] = {}  # token_text's, by id

    @classmethod
    def load(cls, folder: Path, config) -> ChatTokenizer:
        """The tokenizer of the model in ``folder`` (whose parsed ``config`` is given)."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure means the same thing to the user
            raise ModelUnavailable(f"cannot load the tokenizer from {folder}: {exc}") from None
        return cls(tokenizer, config=config, generation=read_generation_config(folder))

    def vocabulary(self) -> dict[str, int]:
        """Every token's text and id, special tokens included: two tokenizers with the same one agree."""
        return self._tokenizer.get_vocab()

    def use_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (Jinja, as in a model's tokenizer_config) instead of the model's."""
        self._tokenizer.chat_template = template

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat template applied to ``messages``, ending where the assistant's answer begins."""
        if not self._tokenizer.chat_template:  # a base model's folder: a clear 400, not transformers' ValueError
            raise BadRequest("this model has no chat template: send the prompt to /v1/completions, or start the head "
                             "with --chat-template FILE", param="messages")
        encoded = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw completion prompt, no template: as the tokenizer encodes text by default (a BOS where it adds one)."""
        return self._tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as the tail reports it (special tokens included): decoded once per id, then looked up (every
        tail names every token it picks, and a decode took 0.1 ms of a 4-bit tail's step)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def default_sampling(self) -> dict:
        """Sampling when a request names none: the model's generation config, else greedy."""
        gen = self._generation
        if not gen.get("do_sample"):
            return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
        return {
            "temperature": float(gen.get("temperature", 1.0)),
            "top_p": float(gen.get("top_p", 1.0)),
            "top_k": int(gen.get("top_k", 0) or 0),
        }


def read_generation_config(folder: Path) -> dict:
    path = Path(folder) / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


# what a chat template must render at startup: a user turn, an answer, a second user turn
SAMPLE_CHAT = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi, how can I help?"},
               {"role": "user", "content": "Tell me about owls."}]


def read_chat_template(path: str) -> str:
    """The text of a ``--chat-template`` file; ModelUnavailable (one line) when it cannot be read or is empty."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelUnavailable(f"--chat-template {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") \
            from None
    if not text.strip():
        raise ModelUnavailable(f"--chat-template {path}: the file is empty")
    return text


def check_chat_template(folder: Path, template: str, path: str) -> None:
    """Render :data:`SAMPLE_CHAT` with ``template`` and the tokenizer of the model in ``folder``, so a broken
    template is refused at startup, not on the first request (ModelUnavailable, one line)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure means the same thing to the user
        raise ModelUnavailable(f"cannot load the tokenizer from {folder}: {exc}") from None
    tokenizer.chat_template = template
    try:
        text = tokenizer.apply_chat_template(SAMPLE_CHAT, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - Jinja syntax, undefined names, raise_exception(...) in the template
        detail = " ".join(str(exc).split()) or exc.__class__.__name__
        raise ModelUnavailable(f"--chat-template {path}: cannot render a simple conversation ({detail})") from None
    if not isinstance(text, str) or "Tell me about owls." not in text:
        raise ModelUnavailable(f"--chat-template {path}: a simple conversation renders without its last message")
