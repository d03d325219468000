"""Unit tests of ``daemon.mesh.text.TextStream`` with the built-in model's real tokenizer.

The tokenizer is loaded straight from the model folder's ``tokenizer.json`` with
the ``tokenizers`` library: that is the very backend ``AutoTokenizer`` wraps for
this model (``clean_up_tokenization_spaces`` is off), and it loads in ~0.1 s
where importing transformers takes several seconds.
"""

from __future__ import annotations

import pytest

from daemon.mesh.text import TextStream

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok(default_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(default_model / "tokenizer.json"))


@pytest.fixture(scope="module")
def decode(tok):
    # what the head's backend does (daemon.node: tokenizer.decode(ids, skip_special_tokens=True))
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def encode(tok):
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def run(stream: TextStream, ids: list[int]) -> list[str]:
    deltas = [stream.push(i) for i in ids]
    deltas.append(stream.finish())
    return deltas


TEXTS = [
    "Hello world, this is a plain sentence.",
    "  leading spaces   and\ttabs\nnew lines\n\n",
    "Emoji: 😀🤖👍🏽 and flags 🇫🇷 done",
    "你好世界，今天天气很好。日本語のテキストです。한국어 텍스트",
    "mixed é ü ß ñ — “quotes” … ∑∫√ ⟨x⟩ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_pushes_equal_full_decode(text, encode, decode):
    ids = encode(text)
    assert len(ids) > 3
    stream = TextStream(decode)
    deltas = run(stream, ids)
    assert "".join(deltas) == decode(ids) == text
    assert stream.text == text
    assert stream.stopped is False


@pytest.mark.parametrize("text", TEXTS)
def test_no_replacement_char_is_ever_emitted(text, encode, decode):
    ids = encode(text)
    stream = TextStream(decode)
    emitted = ""
    for i in ids:
        delta = stream.push(i)
        assert REPLACEMENT not in delta
        emitted += delta
        assert stream.text == emitted  # text is what was emitted so far (no stop strings)
        assert text.startswith(emitted)
    assert REPLACEMENT not in stream.finish()


@pytest.mark.parametrize("text", ["😀🤖👍🏽", "你好世界", "🇫🇷 𝔘𝔫𝔦"])
def test_multibyte_split_across_tokens_is_held_until_complete(text, encode, decode):
    ids = encode(text)
    # precondition: the tokenizer really splits these characters across tokens
    partials = [n for n in range(1, len(ids)) if decode(ids[:n]).endswith(REPLACEMENT)]
    assert partials, "expected at least one token boundary inside a character"
    stream = TextStream(decode)
    for n, i in enumerate(ids, start=1):
        delta = stream.push(i)
        assert REPLACEMENT not in delta
        if n in partials:
            assert delta == ""
    assert stream.text == text
    assert stream.finish() == ""  # nothing was left over


def test_token_by_token_decoding_would_break_emoji(encode, decode):
    """Guard for the test above: decoding ids one at a time really does produce U+FFFD."""
    ids = encode("😀")
    assert REPLACEMENT in "".join(decode([i]) for i in ids)


def test_stop_string_cuts_text_and_sets_stopped(encode, decode):
    ids = encode("Hello world END stop")
    assert [decode([i]) for i in ids] == ["Hello", " world", " END", " stop"]
    stream = TextStream(decode, stop=["END"])
    deltas = [stream.push(i) for i in ids]
    assert "".join(deltas) == "Hello world "
    assert stream.stopped is True
    assert stream.text == "Hello world "
    assert deltas[3] == ""  # pushes after the stop are ignored
    assert stream.finish() == ""
    assert stream.text == "Hello world "


def test_stop_string_spanning_tokens(encode, decode):
    ids = encode("Hello world order")
    stream = TextStream(decode, stop=["lo wor"])
    assert stream.push(ids[0]) == "Hel"  # "lo" could start the stop: held back
    assert stream.stopped is False
    assert stream.push(ids[1]) == ""  # "Hello world" contains the stop at 3
    assert stream.stopped is True
    assert stream.text == "Hel"
    assert stream.push(ids[2]) == ""


def test_partial_stop_prefix_held_then_released(encode, decode):
    ids = encode("Hello world order")
    assert [decode([i]) for i in ids] == ["Hello", " world", " order"]
    stream = TextStream(decode, stop=["world peace"])
    assert stream.push(ids[0]) == "Hello"
    assert stream.push(ids[1]) == " "  # "world" may grow into "world peace": held
    assert stream.text == "Hello "
    assert stream.push(ids[2]) == "world order"  # it did not: released
    assert stream.text == "Hello world order"
    assert stream.stopped is False
    assert stream.finish() == ""


def test_finish_flushes_held_text(encode, decode):
    ids = encode("Hello world")
    stream = TextStream(decode, stop=["world peace"])
    assert "".join(stream.push(i) for i in ids) == "Hello "
    assert stream.finish() == "world"
    assert stream.text == "Hello world"
    assert stream.stopped is False


def test_earliest_of_several_stops_wins(encode, decode):
    ids = encode("alpha beta gamma delta")
    stream = TextStream(decode, stop=["delta", "beta", "gamma"])
    out = "".join(stream.push(i) for i in ids)
    assert out == "alpha "
    assert stream.stopped is True


def test_empty_stop_strings_are_ignored(encode, decode):
    ids = encode("Hello world")
    stream = TextStream(decode, stop=["", "zzz"])
    assert "".join(run(stream, ids)) == "Hello world"
    assert stream.stopped is False


def test_stop_made_of_multibyte_characters(encode, decode):
    text = "你好世界，今天天气很好"
    ids = encode(text)
    stream = TextStream(decode, stop=["世界"])
    deltas = [stream.push(i) for i in ids]
    assert "".join(deltas) == "你好"
    assert all(REPLACEMENT not in d for d in deltas)
    assert stream.stopped is True
    assert stream.text == "你好"


def test_stop_then_completed_emoji_is_cut(encode, decode):
    ids = encode("Hi END 😀")
    assert [decode([i]) for i in ids[:2]] == ["Hi", " END"]
    stream = TextStream(decode, stop=["END "])
    out = "".join(stream.push(i) for i in ids)
    assert out == "Hi "
    assert stream.stopped is True


def test_finish_never_emits_a_stop_string(encode, decode):
    # " \xf0\x9f\x98" (the first bytes of 😀) completes the stop "END " and leaves a partial
    # character, so push() holds everything back without checking stops; generation then
    # ends (max_tokens) and finish() flushes "END \ufffd", stop string included.
    ids = encode("Hi END 😀")[:3]
    stream = TextStream(decode, stop=["END "])
    emitted = "".join(stream.push(i) for i in ids)
    assert emitted == "Hi "
    emitted += stream.finish()
    assert "END" not in emitted
    assert emitted == "Hi "
    assert stream.stopped is True
