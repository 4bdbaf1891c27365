"""Incremental text: the fast tokenizer's own stream (tokenizers' DecodeStream) gives exactly
the text transformers' whole-output `decode` gives, with multi-byte characters split across
tokens held back until complete, as the window decoder does; a stream that refuses a token
hands over to the window decoder without losing or repeating text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from appliance.engine.detokenizer import (
    IncrementalDetokenizer,
    RustTextStream,
    WindowTextStream,
    text_stream,
)
from appliance.models.hf_files import load_tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "Ünïcödé, 日本語のテスト, emoji 🙂🚀 and   spaces\n\n\ttabs.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code",
]


@pytest.fixture(scope="module")
def smollm_tokenizer(default_model: Path) -> object:
    """SmolLM2's real tokenizer (49,152 tokens, byte-level BPE)."""
    return load_tokenizer(default_model.parent)


def streamed(stream: object, ids: list[int]) -> str:
    return "".join(stream.step(t) for t in ids)  # type: ignore[attr-defined]


def test_the_fast_stream_matches_a_whole_decode(smollm_tokenizer: object) -> None:
    tok = smollm_tokenizer
    stream = text_stream(tok)  # type: ignore[arg-type]
    assert isinstance(stream, RustTextStream)
    rng = random.Random(0)
    vocab = tok.vocab_size  # type: ignore[attr-defined]
    cases = [tok.encode(t, add_special_tokens=False) for t in TEXTS]  # type: ignore[attr-defined]
    # Random ids (what the benchmarks send) split multi-byte characters across tokens, and
    # special tokens in the middle are skipped, as in `decode(..., skip_special_tokens=True)`.
    cases += [[rng.randrange(vocab) for _ in range(300)] for _ in range(8)]
    cases.append([tok.bos_token_id, *cases[1], tok.eos_token_id, *cases[0]])  # type: ignore[attr-defined]
    for ids in cases:
        whole = tok.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        fast = streamed(text_stream(tok), ids)  # type: ignore[arg-type]
        window = streamed(WindowTextStream(tok), ids)  # type: ignore[arg-type]
        assert fast == window
        # Both hold back only a trailing partial character, which `decode` shows as U+FFFD.
        assert whole == fast or (whole.startswith(fast) and set(whole[len(fast) :]) == {"\ufffd"})


def test_multibyte_characters_come_out_whole(smollm_tokenizer: object) -> None:
    tok = smollm_tokenizer
    ids = tok.encode("日本語🙂", add_special_tokens=False)  # type: ignore[attr-defined]
    assert len(ids) > 4  # byte-level BPE splits these characters over several tokens
    stream = text_stream(tok)  # type: ignore[arg-type]
    pieces = [stream.step(t) for t in ids]
    assert "".join(pieces) == "日本語🙂"
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # a token that ends mid-character gives no text yet


def test_stop_strings_work_on_the_fast_stream(smollm_tokenizer: object) -> None:
    tok = smollm_tokenizer
    ids = tok.encode("The capital of France is Paris. It is big.", add_special_tokens=False)  # type: ignore[attr-defined]
    detok = IncrementalDetokenizer(tok, ["Paris"])  # type: ignore[arg-type]
    assert isinstance(detok.stream, RustTextStream)
    text = ""
    for t in ids:
        text += detok.add(t)
        if detok.stopped:
            break
    assert text + detok.flush() == "The capital of France is "


class Letters:
    """Token i decodes to the i-th lowercase letter."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class Refuses:
    """Not a tokenizers.Tokenizer: DecodeStream raises on it, as it would on a token it
    cannot place."""


def test_a_refused_token_falls_back_to_the_window_decoder(
    smollm_tokenizer: object, caplog: pytest.LogCaptureFixture
) -> None:
    tok = smollm_tokenizer
    ids = tok.encode(TEXTS[1], add_special_tokens=False)  # type: ignore[attr-defined]
    stream = text_stream(tok)  # type: ignore[arg-type]
    assert isinstance(stream, RustTextStream)
    half = len(ids) // 2
    text = streamed(stream, ids[:half])
    stream.backend = Refuses()  # type: ignore[assignment]
    text += streamed(stream, ids[half:])
    # Nothing lost, nothing said twice: the window decoder took over where the stream stopped.
    assert text == TEXTS[1]
    assert stream.stream is None and "fell back" in caplog.text


def test_a_tokenizer_without_a_rust_backend_uses_the_window() -> None:
    assert isinstance(text_stream(Letters()), WindowTextStream)
    assert streamed(text_stream(Letters()), [7, 4, 11, 11, 14]) == "hello"


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(smollm_tokenizer: object) -> None:
    """`decode` with clean-up strips spaces before punctuation; the Rust stream would not."""
    tok = smollm_tokenizer
    ids = tok.encode("Hello , world . Done !", add_special_tokens=False)  # type: ignore[attr-defined]
    # transformers 5 cleans a BPE tokenizer's text only when forced (it does a WordPiece's).
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    tok.clean_up_tokenization_spaces = True  # type: ignore[attr-defined]
    setattr(tok, forced, True)
    try:
        stream = text_stream(tok)  # type: ignore[arg-type]
        assert isinstance(stream, WindowTextStream)
        text = streamed(stream, ids)
        assert text == tok.decode(ids, skip_special_tokens=True) == "Hello, world. Done!"  # type: ignore[attr-defined]
    finally:
        tok.clean_up_tokenization_spaces = False  # type: ignore[attr-defined]
        setattr(tok, forced, False)
