"""LitServe serving all-MiniLM-L6-v2: the Python-server peer for the minilm comparison.

POST /predict {"text": "a sentence"} -> {"embedding": [384 floats]}. The batching knobs
(max_batch_size, batch_timeout, workers_per_device, fast_queue) come from the command
line so that `bench/batching.py` can try several and keep LitServe's best.
"""

from __future__ import annotations

import argparse
import os

import litserve as ls
from minilm_model import MiniLM


class MiniLMAPI(ls.LitAPI):
    def setup(self, device):
        self.model = MiniLM(threads=int(os.environ.get("OMP_NUM_THREADS", "1")))

    def decode_request(self, request):
        return request["text"]

    def batch(self, inputs):
        return list(inputs)

    def predict(self, x):
        if isinstance(x, str):  # max_batch_size == 1: LitServe passes one input
            return self.model.embed([x])[0]
        return self.model.embed(x)

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {"embedding": output.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-timeout", type=float, default=0.005, help="seconds")
    parser.add_argument("--workers", type=int, default=1, help="workers_per_device")
    parser.add_argument("--fast-queue", action="store_true", help="ZMQ instead of mp.Queue")
    args = parser.parse_args()
    api = MiniLMAPI(max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout)
    server = ls.LitServer(
        api,
        accelerator="cpu",
        devices=1,
        workers_per_device=args.workers,
        fast_queue=args.fast_queue,
    )
    server.run(
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        generate_client_file=False,
        access_log=False,
    )


if __name__ == "__main__":
    main()
