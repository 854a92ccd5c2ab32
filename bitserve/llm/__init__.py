"""bitserve's LLM engine: paged KV cache, continuous batching, prefix caching.

from bitserve.llm import LLM, SamplingParams
outputs = LLM("models/my-llama").generate(["Hello"], SamplingParams(max_tokens=32))
"""

from bitserve.llm.config import EngineConfig
from bitserve.llm.engine import LLM, LLMEngine
from bitserve.llm.outputs import CompletionOutput, RequestOutput
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.scheduler import RequestTooLong

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "RequestTooLong",
    "SamplingParams",
]
