"""Validate a quantized model against its reference, side by side.

LLM: perplexity on held-out text (non-overlapping windows from an empty cache, as
tools/train_lm.py scores tinylm), next-token agreement (the share of positions where
both models' argmax is the same token, on the same text), greedy generation agreement
over 8 prompts from across the text: the share of greedily generated tokens that match,
and the mean number before the first difference, since one near-tie changes all that
follows), weight memory, and batch-1 decode tokens/s through the engine.
Encoders: cosine similarity of each text's embedding to the reference's, memory,
sentences/s.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bitserve.quantize.scoring import text_token_ids, window_logits, windows


@dataclass
class LLMScores:
    name: str
    weight_bytes: int = 0
    perplexity: float = 0.0
    scored_tokens: int = 0
    decode_tok_s: float = 0.0
    predictions: torch.Tensor | None = field(default=None, repr=False)  # argmax per position
    generated: list[list[int]] = field(default_factory=list, repr=False)  # per prompt


GREEDY_PROMPTS = 8  # prompts for greedy agreement, from across the text
PROMPT_TOKENS = 32


def decode_speed(engine, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """Greedy batch-1 decode: (seconds after the first token, tokens after it, tokens)."""
    from bitserve.llm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request("eval", prompt, params)
    first = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None:
                first = time.perf_counter()
            tokens = list(out.outputs[0].token_ids)
    return time.perf_counter() - (first or time.perf_counter()), len(tokens) - 1, tokens


def greedy_prompts(ids: list[int], length: int) -> list[list[int]]:
    step = max(len(ids) // GREEDY_PROMPTS, length)
    return [ids[i : i + length] for i in range(0, len(ids) - length + 1, step)][:GREEDY_PROMPTS]


def score_llm(
    folder: Path, name: str, text: str, window: int, max_tokens: int | None, new_tokens: int
) -> LLMScores:
    from bitserve.llm.engine import LLMEngine
    from bitserve.llm.quant.quantize import weight_bytes

    engine = LLMEngine(folder, device="cpu", num_kv_blocks=64, max_model_len=None)
    model = engine.runner.model
    ids = text_token_ids(engine.config.model, text)
    window = min(window, engine.config.max_model_len)
    scores = LLMScores(name, weight_bytes=weight_bytes(model))
    length = min(PROMPT_TOKENS, window // 2)
    new_tokens = min(new_tokens, engine.config.max_model_len - length - 1)
    decode_speed(engine, ids[:length], 4)  # warm-up
    seconds = tokens = 0.0
    for prompt in greedy_prompts(ids, length):
        s, n, generated = decode_speed(engine, prompt, new_tokens)
        seconds, tokens = seconds + s, tokens + n
        scores.generated.append(generated)
    scores.decode_tok_s = tokens / seconds if seconds > 0 else 0.0
    nll, predictions = 0.0, []
    for chunk in windows(ids, window, max_tokens):  # the engine is done: its pool is reused
        logits = window_logits(model, chunk)[:-1]
        target = torch.tensor(chunk[1:])
        nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        predictions.append(logits.argmax(-1))
        scores.scored_tokens += len(target)
    scores.perplexity = math.exp(nll / max(scores.scored_tokens, 1))
    scores.predictions = torch.cat(predictions) if predictions else torch.zeros(0)
    return scores


def evaluate_llm(
    folder: Path,
    reference: Path | None,
    text: str,
    window: int = 256,
    max_tokens: int | None = None,
    new_tokens: int = 64,
) -> dict:
    model = score_llm(folder, "model", text, window, max_tokens, new_tokens)
    result = {"kind": "llm", "model": summary(model, folder)}
    if reference is None:
        return result
    ref = score_llm(reference, "reference", text, window, max_tokens, new_tokens)
    result["reference"] = summary(ref, reference)
    same = (model.predictions == ref.predictions).float().mean()
    n = matches = prefix = 0
    for ours, theirs in zip(model.generated, ref.generated, strict=True):
        pairs = list(zip(ours, theirs, strict=False))
        n += len(pairs)
        matches += sum(a == b for a, b in pairs)
        prefix += next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    prompts = max(len(model.generated), 1)
    result["comparison"] = {
        "perplexity_change": model.perplexity / ref.perplexity - 1,
        "next_token_agreement": float(same),
        "greedy_agreement": matches / max(n, 1),  # same token at the same position
        "greedy_same_prefix": prefix / prompts,  # mean tokens before the first difference
        "greedy_prompts": len(model.generated),
        "greedy_tokens": n,
        "memory_ratio": model.weight_bytes / ref.weight_bytes,
        "decode_speedup": model.decode_tok_s / max(ref.decode_tok_s, 1e-9),
    }
    return result


def summary(scores: LLMScores, folder: Path) -> dict:
    out = asdict(scores)
    out.pop("predictions")
    out.pop("generated")
    out["folder"] = str(folder)
    return out


# -- encoders --------------------------------------------------------------------------------
def load_embedder(folder: Path):
    """(model, tokenizer, settings) for a full-precision or quantized encoder folder."""
    from transformers import AutoTokenizer

    from bitserve.backends.hf import _sentence_transformers_settings
    from bitserve.llm.quant.encoder import auto_class, load_encoder

    quant = json.loads((folder / "config.json").read_text()).get("quantization_config")
    auto = auto_class(folder)
    if (quant or {}).get("quant_method") == "bitserve":
        model = load_encoder(folder, auto, quant)
    else:
        model = auto.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval().float(), tokenizer, _sentence_transformers_settings(folder)


@torch.inference_mode()
def embed(model, tokenizer, settings: dict, texts: list[str], batch: int = 32) -> torch.Tensor:
    """Mean-pooled (or CLS), optionally normalised embeddings, as the hf backend makes them."""
    out = []
    max_length = int(settings.get("max_length") or 256)
    for i in range(0, len(texts), batch):
        enc = tokenizer(
            texts[i : i + batch],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        hidden = model(**enc).last_hidden_state
        if settings.get("pooling") == "cls":
            pooled = hidden[:, 0]
        else:
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        if settings.get("normalize"):
            pooled = torch.nn.functional.normalize(pooled, dim=1)
        out.append(pooled.float())
    return torch.cat(out)


def score_encoder(folder: Path, texts: list[str]) -> tuple[dict, torch.Tensor]:
    from bitserve.llm.quant.quantize import weight_bytes

    model, tokenizer, settings = load_embedder(folder)
    embed(model, tokenizer, settings, texts[:8])  # warm-up, kernel choice
    start = time.perf_counter()
    vectors = embed(model, tokenizer, settings, texts)
    seconds = time.perf_counter() - start
    info = {
        "folder": str(folder),
        "weight_bytes": weight_bytes(model),
        "sentences_per_s": len(texts) / seconds,
    }
    return info, vectors


def evaluate_encoder(folder: Path, reference: Path | None, texts: list[str]) -> dict:
    info, vectors = score_encoder(folder, texts)
    result = {"kind": "encoder", "model": info, "sentences": len(texts)}
    if reference is None:
        return result
    ref_info, ref_vectors = score_encoder(reference, texts)
    cosine = torch.nn.functional.cosine_similarity(vectors, ref_vectors, dim=1)
    result["reference"] = ref_info
    result["comparison"] = {
        "cosine_min": float(cosine.min()),
        "cosine_mean": float(cosine.mean()),
        "memory_ratio": info["weight_bytes"] / ref_info["weight_bytes"],
        "speedup": info["sentences_per_s"] / ref_info["sentences_per_s"],
    }
    return result


def format_table(result: dict) -> str:
    """The two models side by side, then the comparison."""
    columns = [k for k in ("model", "reference") if k in result]
    keys = [k for k in result["model"] if k not in ("folder", "name")]
    lines = [f"{'':<22}" + "".join(f"{c:>16}" for c in columns)]
    for key in keys:
        cells = "".join(f"{fmt(key, result[c][key]):>16}" for c in columns)
        lines.append(f"{key:<22}{cells}")
    for key, value in result.get("comparison", {}).items():
        lines.append(f"{key:<22}{fmt(key, value):>16}")
    return "\n".join(lines)


def fmt(key: str, value) -> str:
    if key == "weight_bytes":
        return f"{value / 2**20:.2f} MiB"
    if isinstance(value, float):
        if key in ("perplexity_change",):
            return f"{value:+.2%}"
        if "agreement" in key:
            return f"{value:.2%}"
        return f"{value:.4g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)
