"""Train the teacher detector on the synthetic digits set and write its weights.

    python tools/train_detector.py --out models/detector/teacher.safetensors

One torch thread, seeded: about 15 minutes on one core. `--init` starts from earlier
weights (the committed teacher was trained on scikit-learn's digits, then fine-tuned
from there on both digit sources with augmentation: train_log.txt). The teacher is the slow,
accurate model that `bitserve optimize` speeds up; tools/build_models.py exports it to
the servable `models/detector/1/model.onnx`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's bitserve

from bitserve.vision import net, train, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/detector/teacher.safetensors"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--init", type=Path, help="start from these weights")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = weights.load(args.init) if args.init else net.CenterNet(net.TEACHER_WIDTHS)
    config = train.TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    minutes = train.train(model, config, log=lambda line: print(line, flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    weights.save(model, args.out, train_minutes=round(minutes, 2), steps=args.steps)
    print(
        json.dumps({"started": started, "train_minutes": round(minutes, 2), "out": str(args.out)})
    )


if __name__ == "__main__":
    main()
