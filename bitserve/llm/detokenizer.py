"""Incremental detokenisation and stop strings.

Text grows one token at a time, yet a token can end inside a UTF-8 character (byte
fallback, byte-level BPE) or inside a stop string that the next token completes. So
the detokenizer decodes a small window of recent tokens (vLLM's prefix/read offsets),
holds back text that ends in U+FFFD, and never releases a suffix that could still be
the beginning of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bitserve.llm.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
WINDOW = 6  # tokens of context decoded before the new ones (spaces, merges)


def raw_decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """`tokenizer.decode`, or the Rust tokenizer's own decode where that is the same.

    A fast transformers tokenizer whose `clean_up_tokenization_spaces` is off decodes by
    calling its `tokenizers.Tokenizer`; the Python around it (argument conversion,
    dispatch) cost 10x the decode itself, twice per generated token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.decode = raw_decoder(tokenizer)
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.prefix_offset = max(len(self.token_ids) - WINDOW, 0)
        self.read_offset = len(self.token_ids)
        self.text = ""  # decoded output so far (stop string cut off once found)
        self.num_emitted = 0  # characters of `text` already released to the caller
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, self.params.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; return the stop string if it completed one."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return None  # an incomplete character: wait for the next token
        start = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._find_stop(start) if check_stop else None

    def _find_stop(self, new_from: int) -> str | None:
        for stop in self.params.stop:
            at = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1:
                end = at + len(stop) if self.params.include_stop_str_in_output else at
                self.text = self.text[:end]
                self.stopped_by = stop
                return stop
        return None

    def releasable(self, finished: bool) -> int:
        """How much of `text` may be shown: all of it once finished; otherwise all but a
        suffix that is the start of some stop string."""
        if finished or not self.params.stop:
            return len(self.text)
        hold = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return len(self.text) - hold

    def new_text(self, finished: bool) -> str:
        """The delta since the last call (for streaming)."""
        end = max(self.releasable(finished), self.num_emitted)
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta
