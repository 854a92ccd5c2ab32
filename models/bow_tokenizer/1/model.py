"""Words to bow_classifier's vocabulary: lower-cased runs of letters, digits and
apostrophes, each hashed (CRC-32) to an id in 1..999; 0 pads."""

import re
import zlib

import numpy as np

WORD = re.compile(r"[a-z0-9']+")
VOCAB = 1000


def token_ids(text: str) -> list[int]:
    return [1 + zlib.crc32(w.encode()) % (VOCAB - 1) for w in WORD.findall(text.lower())] or [0]


class Tokenizer:
    def execute(self, requests):
        """Each request's ids with its own length (the texts of a request of several
        rows are padded with 0 to its longest); a text that is not UTF-8 fails its own
        request only (a ValueError in its place: 400)."""
        return [self.tokenize(request["text"][:, 0]) for request in requests]

    def tokenize(self, texts):
        try:
            rows = [token_ids(t.decode()) for t in texts]
        except UnicodeDecodeError:
            return ValueError("input 'text' is not UTF-8")
        ids = np.zeros((len(rows), max(map(len, rows))), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        return {"input_ids": ids}
