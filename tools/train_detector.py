"""Train the teacher detector on the synthetic digits set and write its weights.

    python tools/train_detector.py --out models/detector/teacher.safetensors

One torch thread, seeded: about 15 minutes on one core. The teacher is the slow,
accurate model that `bitserve optimize` speeds up; tools/build_models.py exports it to
the servable `models/detector/1/model.onnx`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bitserve.vision import net, train, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/detector/teacher.safetensors"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = net.CenterNet(net.TEACHER_WIDTHS)
    config = train.TrainConfig(steps=args.steps, batch=args.batch)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    minutes = train.train(model, config, log=lambda line: print(line, flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    weights.save(model, args.out, train_minutes=round(minutes, 2), steps=args.steps)
    print(
        json.dumps({"started": started, "train_minutes": round(minutes, 2), "out": str(args.out)})
    )


if __name__ == "__main__":
    main()
