"""Incremental detokenisation: no broken UTF-8, no partial stop string, ever."""

from __future__ import annotations

from transformers import AutoTokenizer

from bitserve.llm.detokenizer import IncrementalDetokenizer
from bitserve.llm.sampling_params import SamplingParams

TEXT = "héllo wörld ☃ 日本語 the quick brown fox"


def stream(tokenizer, ids, params):
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, stop = [], None
    for i, token in enumerate(ids):
        stop = detok.add_token(token)
        finished = stop is not None or i == len(ids) - 1
        deltas.append(detok.new_text(finished))
        if stop is not None:
            break
    return deltas, detok, stop


def test_deltas_add_up_and_never_hold_a_broken_character(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = tok.encode(TEXT)
    deltas, detok, _ = stream(tok, ids, SamplingParams())
    assert "".join(deltas) == TEXT == detok.text
    assert all("\ufffd" not in d for d in deltas)
    # single bytes of multibyte characters exist in this vocabulary: the test bites
    assert any("\ufffd" in tok.decode([t]) for t in ids)


def test_a_stop_string_spanning_tokens_is_cut_and_never_partially_emitted(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = tok.encode(TEXT)
    deltas, _detok, stop = stream(tok, ids, SamplingParams(stop=["wörld ☃"]))
    assert stop == "wörld ☃"
    assert "".join(deltas) == "héllo "
    assert all("w" not in d for d in deltas)


def test_include_stop_string(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    params = SamplingParams(stop=["日本"], include_stop_str_in_output=True)
    deltas, _, _ = stream(tok, tok.encode(TEXT), params)
    assert "".join(deltas) == "héllo wörld ☃ 日本"


def test_a_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    deltas, _detok, stop = stream(tok, tok.encode(TEXT), SamplingParams(stop=["the slow"]))
    assert stop is None
    assert "".join(deltas) == TEXT


def test_the_raw_decoder_equals_transformers_decode(llama_dir, tmp_path):
    """The shortcut to the Rust tokenizer decodes exactly as `tokenizer.decode`, for the
    test model's tokenizer and for the default LM's (tinylm), specials kept or skipped."""
    import random
    from pathlib import Path

    from bitserve.llm.detokenizer import raw_decoder

    tinylm = Path(__file__).resolve().parents[2] / "models" / "tinylm" / "1"
    for folder in (llama_dir, tinylm):
        tok = AutoTokenizer.from_pretrained(folder)
        decode = raw_decoder(tok)
        rng = random.Random(0)
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))]
            for skip in (False, True):
                assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)
