"""One engine configuration, validated once and passed whole to every component.

Follows nano-vllm's `Config`: a dataclass whose `__post_init__` checks the values
and reads the model's `config.json`, so the scheduler, block manager and model
runner never take long argument lists.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

import torch
from pydantic import TypeAdapter, ValidationError

from bitserve.llm.parallel import STARTUP_TIMEOUT_S, check_parallel
from bitserve.llm.rope import derived_max_len

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
KV_CACHE_MEMORY_CAP = 8 << 30  # on the CPU: never take more than 8 GiB for KV by default
KV_CACHE_MEMORY_FRACTION = 0.25  # of the host memory available when the engine starts
# tokens a step may schedule by default: the CPU's as before; on a GPU more, so that a
# prefill chunk's matmuls have enough rows to be compute-bound
MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def check_type(name: str, value: Any, hint: Any) -> None:
    """`value` is a `hint`, strictly (no "8" for 8, no true for 1), else a ValueError
    that names it: "max_num_seqs must be int, got '8'". An integer is a float (TOML's
    `confidence = 0` is an int; pydantic's strict float would refuse it)."""
    if type(value) is int and float in _parts(hint) and abs(value) < 1 << 1023:
        value = float(value)  # (a larger one is refused below, naming the field)
    try:
        _adapter(hint).validate_python(value, strict=True)
    except ValidationError:
        raise ValueError(f"{name} must be {_words(hint)}, got {value!r}") from None


@functools.cache
def _adapter(hint: Any) -> TypeAdapter:
    return TypeAdapter(hint)


def _parts(hint: Any) -> tuple:
    """`int | None` as (int, NoneType)."""
    return get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)


def _words(hint: Any) -> str:
    """`int | None` as "int or None"."""
    parts = _parts(hint)
    return " or ".join(
        "None" if p is type(None) else getattr(get_origin(p) or p, "__name__", str(p))
        for p in parts
    )


def available_memory() -> int:
    """Bytes the kernel says a new allocation can get (MemAvailable), without psutil."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def default_kv_cache_memory(device: str = "cpu") -> int:
    """On the CPU: a share of the host memory available now, at most 8 GiB."""
    return int(min(available_memory() * KV_CACHE_MEMORY_FRACTION, KV_CACHE_MEMORY_CAP))


def pick_dtype(dtype: str, device: str, hf: dict[str, Any]) -> str:
    """`dtype = "auto"`: float32 on the CPU (the C kernels are fp32); on a GPU the
    checkpoint's own dtype when it is a half type, else bfloat16 (fp32 runs a GPU's
    tensor cores at a fraction of their rate and doubles the weights' reads)."""
    if dtype != "auto":
        return DTYPE_ALIASES.get(dtype, dtype)
    if device == "cpu":
        return "float32"
    stored = hf.get("torch_dtype") or hf.get("dtype")  # transformers < 5 / >= 5
    return stored if stored in ("float16", "bfloat16") else "bfloat16"


def checkpoint_bytes(folder: Path | None, dtype: torch.dtype, gguf_file: Path | None) -> int:
    """What the weights take once loaded in `dtype` (floating tensors converted, others
    as stored), read from the safetensors headers without reading a weight; a GGUF
    file's size. 0 without a model (unit tests)."""
    if gguf_file is not None:
        return gguf_file.stat().st_size
    if folder is None:
        return 0
    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = math.prod(info["shape"])
            stored = info["data_offsets"][1] - info["data_offsets"][0]
            floating = info["dtype"] in ("F64", "F32", "F16", "BF16")
            total += numel * dtype.itemsize if floating else stored
    return total


def activation_bytes(hf: dict[str, Any], tokens: int, seqs: int, dtype: torch.dtype) -> int:
    """An estimate of a step's transient memory: per token the residual stream, norm
    and attention outputs, q/k/v and the MLP's gate, up and activation; the fp32 logits
    (and probabilities) of the rows sampled. Prompt-logprob rows are not counted."""
    hidden = int(hf.get("hidden_size") or hf.get("n_embd") or 0)
    inner = int(hf.get("intermediate_size") or hf.get("n_inner") or 4 * hidden)
    vocab = int(hf.get("vocab_size") or 0)
    per_token = (6 * hidden + 3 * inner) * dtype.itemsize
    return tokens * per_token + seqs * vocab * 4 * 2


def gpu_kv_cache_memory(config: EngineConfig) -> int:
    """The KV pool on a GPU, as vLLM reads `gpu_memory_utilization`: once the pool is
    allocated, at most that fraction of the device's total memory is in use, counting
    what is already taken (other processes, models loaded before), this rank's share of
    the weights and a step's activations. No cap: the pool is what is left."""
    free, total = torch.cuda.mem_get_info(config.torch_device)
    weights = checkpoint_bytes(config.model, config.torch_dtype, config.gguf_file)
    weights //= config.world_size  # each rank holds its heads/columns or its layers
    step = activation_bytes(
        config.hf_config, config.max_num_batched_tokens, config.max_num_seqs, config.torch_dtype
    )
    in_use = total - free
    pool = int(config.gpu_memory_utilization * total) - in_use - weights - step
    if pool <= 0:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} of {config.device}'s "
            f"{total / gib:.1f} GiB leaves no KV cache: {in_use / gib:.1f} GiB in use "
            f"already, weights {weights / gib:.1f} GiB, a step's activations "
            f"{step / gib:.1f} GiB; raise it, or lower max_num_batched_tokens"
        )
    return pool


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each decoder layer's attention, "full_attention" or "sliding_attention", as
    transformers reads it: `layer_types` when config.json has it, else each family's
    rule (Gemma 2 alternates, Gemma 3 every `sliding_window_pattern`-th layer is global,
    Qwen slides from `max_window_layers` on when `use_sliding_window`, Mistral and
    Phi-3 slide everywhere)."""
    n = int(hf.get("num_hidden_layers") or hf.get("n_layer") or 0)
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    kind = hf.get("model_type", "")
    slides: list[bool]
    if not hf.get("sliding_window"):
        slides = [False] * n
    elif kind == "gemma2":
        slides = [bool((i + 1) % 2) for i in range(n)]
    elif kind.startswith("gemma3"):
        pattern = hf.get("sliding_window_pattern", 6)
        slides = [bool((i + 1) % pattern) for i in range(n)]
    elif kind.startswith("qwen"):
        first = hf.get("max_window_layers", 0)
        slides = [bool(hf.get("use_sliding_window")) and i >= first for i in range(n)]
    else:
        slides = [True] * n
    return ["sliding_attention" if s else "full_attention" for s in slides]


def layer_windows(hf: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window in tokens, None for a global layer."""
    window = hf.get("sliding_window")
    return [window if t == "sliding_attention" else None for t in layer_types(hf)]


def kv_window(hf: dict[str, Any]) -> int | None:
    """The tokens every layer may still attend to behind the newest one: the largest
    window when every layer slides (older blocks can be freed), else None."""
    windows = layer_windows(hf)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def resolve_device(device: str) -> str:
    """Resolve "auto" (cuda when torch sees a GPU, else cpu); check "cpu", "cuda", "cuda:N"."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device != "cpu":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch.cuda.is_available() is False")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)"
            )
    return device


@dataclass
class EngineConfig:
    """Everything the engine needs to know; `model` may be None in unit tests."""

    model: str | Path | None = None
    # "auto": float32 on the CPU; on a GPU the checkpoint's fp16/bf16, else bfloat16. On
    # the CPU "bfloat16" is the linear layers' weights only (csrc/bf16.c): activations,
    # norms, embeddings and the KV cache stay fp32, and every product accumulates in fp32
    dtype: str = "auto"
    block_size: int = 16
    # bytes (per rank); None: on the CPU a share of available memory (at most 8 GiB), on
    # a GPU what gpu_memory_utilization leaves after the weights and activations
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests, benchmarks)
    gpu_memory_utilization: float = 0.9  # the share of a GPU's memory the engine may fill
    max_num_batched_tokens: int | None = None  # None: 2048 on the CPU, 8192 on a GPU
    max_num_seqs: int = 256
    # a step that starts new prompts waits this share of their predicted prefill time (at
    # most MAX_BATCH_WAIT_S) so that requests arriving with them share it; 0: never
    batch_wait: float = 0.05
    max_model_len: int | None = None  # None: derived from config.json (llm/rope.py)
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    device: str = "auto"  # "cpu", "cuda", "cuda:N"; "auto": cuda when available, else cpu
    enforce_eager: bool = False  # true: no CUDA graphs for decode steps (model_runner.py)
    # parallelism (parallel.py): heads/columns split over tensor_parallel_size ranks,
    # layers over pipeline_parallel_size stages; ranks other than 0 are worker processes
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor: str = "mp"  # "mp": local processes; "ray": Ray actors
    placement_strategy: str = "PACK"  # the Ray placement group's strategy for the workers
    distributed_timeout_s: float = 120.0  # a collective waiting longer fails the step
    # structured outputs (structured.py): free JSON strings at most this long, and no
    # free keys; for models that never close a string on their own (None: unbounded)
    guided_max_string: int | None = None
    # LoRA (lora.py): adapters resident at once (0: no LoRA), their largest rank, and
    # those registered at start, name -> PEFT folder (relative: to the model folder)
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_modules: dict[str, str] = field(default_factory=dict)
    # speculative decoding (speculative.py): { method = "ngram" | "draft", model = ...,
    # num_tokens = k }; None: off
    speculative: dict[str, Any] | None = None

    @property
    def startup_timeout_s(self) -> float:
        """How long workers may take to start and load their share of the model."""
        return max(self.distributed_timeout_s, STARTUP_TIMEOUT_S)

    # a GGUF file's block-format weights (Q4_K, Q8_0, ...) meet activations rounded to int8
    # per 32 columns ("int8": llama.cpp's own CPU scheme, VNNI dot products, csrc/ggml.c)
    # or fp32 ones ("fp32": llama.cpp's dequantized weights to fp32 rounding, slower)
    gguf_activations: str = "int8"

    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    # a llama.cpp file (gguf.py): `model` is then its companion folder (config, tokenizer)
    gguf_file: Path | None = None

    def __post_init__(self) -> None:
        self.check_types()
        if DTYPE_ALIASES.get(self.dtype, self.dtype) not in (*DTYPES, "auto"):
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:  # (NaN too)
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        self.device = resolve_device(self.device)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS["cpu" if self.on_cpu else "cuda"]
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.gguf_activations not in ("int8", "fp32"):
            raise ValueError(
                f"gguf_activations must be 'int8' or 'fp32', got {self.gguf_activations!r}"
            )
        if not 0 <= self.batch_wait <= 1:  # (NaN too)
            raise ValueError(f"batch_wait must be a number in [0, 1], got {self.batch_wait!r}")
        if self.model is not None:
            self.model = Path(self.model)
            self.read_gguf()
            config_file = self.model / "config.json"
            if not config_file.is_file():
                raise FileNotFoundError(f"{config_file} not found: not a Hugging Face model folder")
            self.hf_config = json.loads(config_file.read_text())
        self.dtype = pick_dtype(self.dtype, self.device, self.hf_config)
        if self.max_model_len is None:  # what the checkpoint allows, its RoPE scaling too
            self.max_model_len = derived_max_len(self.hf_config)
        self.check_parallel()
        self.check_lora()
        if self.kv_cache_memory is None and self.num_kv_blocks is None:
            if self.on_cpu:  # the ranks share this host's memory (a GPU each has its own)
                self.kv_cache_memory = default_kv_cache_memory() // self.world_size
            else:
                self.kv_cache_memory = gpu_kv_cache_memory(self)

    def check_types(self) -> None:
        """Each field holds its annotated type, strictly (no "8" for 8, no true for 1), so
        a config file's wrong type is refused naming the field, not met later as a
        TypeError from a comparison."""
        hints = get_type_hints(EngineConfig)
        for f in fields(self):
            check_type(f.name, getattr(self, f.name), hints[f.name])

    def check_lora(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 and max_lora_rank >= 1")
        if self.lora_modules and not self.max_loras:
            raise ValueError("lora_modules needs max_loras >= 1 (adapters resident at once)")
        if self.max_loras and self.world_size > 1:
            raise ValueError("LoRA adapters are not served under tensor/pipeline parallelism")

    def read_gguf(self) -> None:
        """A .gguf file (or a folder holding one instead of config.json) is served from
        its companion folder of config and tokenizer, its weights read from the file."""
        from bitserve.llm.gguf import companion_folder, gguf_file

        file = gguf_file(self.model)
        if file is not None:
            self.gguf_file = file
            self.model = companion_folder(file)

    def check_parallel(self) -> None:
        check_parallel(self.hf_config, self.tensor_parallel_size, self.pipeline_parallel_size)
        if self.distributed_executor not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor must be 'mp' or 'ray', got {self.distributed_executor!r}"
            )
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                f"got {self.placement_strategy!r}"
            )
        local_gpus = not self.on_cpu and self.distributed_executor == "mp"
        if local_gpus and self.world_size > 1:  # Ray gives each worker a GPU of its own
            first = self.torch_device.index or 0
            if first + self.world_size > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} x pipeline_parallel_"
                    f"size={self.pipeline_parallel_size} needs {self.world_size} GPUs, one a "
                    f"rank (cuda:{first}..cuda:{first + self.world_size - 1}), but torch sees "
                    f"{torch.cuda.device_count()}; ranks never share a GPU"
                )

    def rank_device(self, rank: int) -> str:
        """Where rank `rank` runs: the CPU for all; on cuda rank 0 on `device` and rank r
        on the r-th GPU after it, each its own; a Ray worker on the one GPU Ray gave it
        (it sees that one alone, as cuda:0)."""
        if self.on_cpu or rank == 0:
            return self.device
        if self.distributed_executor == "ray":
            return "cuda:0"
        return f"cuda:{(self.torch_device.index or 0) + rank}"

    @property
    def world_size(self) -> int:
        """Processes that run the model: 1 is this process alone."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activations' dtype (fp32 for bfloat16 on the CPU: see `weight_dtype`)."""
        if self.on_cpu and self.dtype == "bfloat16":
            return torch.float32
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self) -> torch.dtype:
        """The linear layers' weights: the dtype asked for (models/layers.store_linears)."""
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def on_cpu(self) -> bool:
        """The C kernels and huge-page pools exist only here."""
        return self.device == "cpu"
