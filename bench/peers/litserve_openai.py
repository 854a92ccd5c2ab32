"""LitServe's OpenAI spec with a deterministic streaming "model": an independent
OpenAI-compatible server to check `bitserve bench`'s OpenAI workload against.

POST /v1/chat/completions (LitServe's OpenAISpec serves only chat). The model waits
`--prefill-ms`, then yields max_tokens tokens `tok0 tok1 ...`, one every `--token-ms`,
and reports usage (prompt tokens = words of the last message), so a benchmark knows
what TTFT, TPOT and token counts it should measure.
"""

from __future__ import annotations

import argparse
import time

import litserve as ls
from litserve.specs.openai import OpenAISpec


class TickerAPI(ls.LitAPI):
    def __init__(self, prefill_ms: float, token_ms: float, **kwargs):
        super().__init__(spec=OpenAISpec(), **kwargs)
        self.prefill, self.step = prefill_ms / 1e3, token_ms / 1e3

    def setup(self, device):
        pass

    def predict(self, request, context):
        prompt = request.messages[-1].content or ""
        prompt_tokens = len(str(prompt).split())
        max_tokens = context.get("max_tokens") or context.get("max_completion_tokens") or 16
        time.sleep(self.prefill)
        for i in range(max_tokens):
            if i:
                time.sleep(self.step)
            yield {
                "role": "assistant",
                "content": f"tok{i} ",
                "prompt_tokens": prompt_tokens,
                "completion_tokens": i + 1,
                "total_tokens": prompt_tokens + i + 1,
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill-ms", type=float, default=20.0)
    parser.add_argument("--token-ms", type=float, default=5.0)
    args = parser.parse_args()
    api = TickerAPI(args.prefill_ms, args.token_ms)
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1)
    server.run(
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        generate_client_file=False,
        access_log=False,
    )


if __name__ == "__main__":
    main()
