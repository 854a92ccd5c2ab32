"""bitserve's LLM engine: paged KV cache, continuous batching, prefix caching.

from bitserve.llm import LLM, SamplingParams
outputs = LLM("models/my-llama").generate(["Hello"], SamplingParams(max_tokens=32))

Split over processes (parallel.py, workers.py): `LLM(path, tensor_parallel_size=2,
pipeline_parallel_size=2)` runs 4 ranks, this process and 3 workers (Ray actors with
`distributed_executor="ray"`); a script doing so needs `if __name__ == "__main__":`.
"""

from bitserve.llm.config import EngineConfig
from bitserve.llm.engine import LLM, LLMEngine
from bitserve.llm.outputs import CompletionOutput, RequestOutput
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.scheduler import RequestTooLong
from bitserve.llm.workers import WorkerDied

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "RequestTooLong",
    "SamplingParams",
    "WorkerDied",
]
