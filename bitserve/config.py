"""The schema of a model's `config.toml`, in Triton's vocabulary.

A model folder holds `config.toml` and numeric version folders:

    models/mlp/config.toml
    models/mlp/1/model.pt2

The fields mirror Triton's `config.pbtxt` (`max_batch_size`, `input`, `output`,
`dynamic_batching`, `instance_group`, `version_policy`, `model_warmup`) so that a Triton
user reads them without a manual; times are in milliseconds rather than microseconds.
A config that does not validate is refused with an error naming the file and the field.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bitserve.tensors import DATATYPES


class ConfigError(Exception):
    """A model config that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Strict):
    """One input or output. `dims` exclude the batch dimension when `max_batch_size > 0`."""

    name: Annotated[str, Field(min_length=1)]
    datatype: str
    dims: list[int]
    optional: bool = False
    # Variable-length inputs (token ids): requests in one batch are padded to the
    # longest along the first -1 dimension with `pad_value`; `mask` names the extra
    # input (1 = real, 0 = pad) that the batcher then passes to the model.
    ragged: bool = False
    pad_value: float = 0
    mask: str | None = None
    # The values the model can take, both ends inclusive (token ids below the vocabulary
    # size): a request outside gets a 400 before it can fail the batch it would join.
    value_range: tuple[float, float] | None = None
    # An output's class names, one per line, in a file of the model's folder (Triton's
    # label_filename): the classification extension answers "score:index:label".
    labels: str | None = None

    @model_validator(mode="after")
    def _check(self) -> TensorSpec:
        if self.datatype not in DATATYPES:
            raise ValueError(f"datatype {self.datatype!r} is not one of {sorted(DATATYPES)}")
        if any(d < -1 or d == 0 for d in self.dims):
            raise ValueError(f"dims {self.dims} may hold positive sizes or -1 only")
        if self.ragged and -1 not in self.dims:
            raise ValueError("ragged=true needs a -1 dimension to pad along")
        if self.mask is not None and not self.ragged:
            raise ValueError("mask is only meaningful with ragged=true")
        if self.value_range is not None and (
            self.datatype == "BYTES" or self.value_range[0] > self.value_range[1]
        ):
            raise ValueError(f"value_range {list(self.value_range)}: numeric and not empty")
        return self


class DynamicBatching(_Strict):
    """Triton's `dynamic_batching` block.

    A batch leaves when it reaches `max_batch_size` rows (or the largest preferred size
    that the queue can form), or when its oldest request has waited `max_queue_delay_ms`
    since arrival. `dispatch_when_idle` (a bitserve addition, on by default) sends a
    request that finds an empty queue and a free instance at once: there is nothing to
    batch it with, and waiting would only add latency at low load. Set it false for
    Triton's exact behaviour.
    """

    max_queue_delay_ms: Annotated[float, Field(ge=0)] = 0.0
    preferred_batch_sizes: list[Annotated[int, Field(gt=0)]] = []
    max_queue_size: Annotated[int, Field(ge=0)] = 0  # 0 = unbounded
    default_timeout_ms: Annotated[float, Field(ge=0)] = 0.0  # 0 = none
    allow_timeout_override: bool = True  # a request may only shorten the timeout
    priority_levels: Annotated[int, Field(ge=1)] = 1
    default_priority_level: Annotated[int, Field(ge=0)] = 0  # 0 = lowest level
    dispatch_when_idle: bool = True

    @model_validator(mode="after")
    def _check(self) -> DynamicBatching:
        if self.default_priority_level > self.priority_levels:
            raise ValueError(
                f"default_priority_level {self.default_priority_level} exceeds "
                f"priority_levels {self.priority_levels}"
            )
        return self


class Autoscaling(_Strict):
    """Ray replicas scaled on load, in Ray Serve's `autoscaling_config` words: the
    count aims at `target_ongoing_requests` per replica, between min and max; a need
    held `upscale_delay_s` adds replicas, a surplus held `downscale_delay_s` drains one
    (no request cut) and removes it. min_replicas = 0 scales to zero after idle; the
    next request waits for a replica to start (--lazy-load's cold start)."""

    min_replicas: Annotated[int, Field(ge=0)] = 1
    max_replicas: Annotated[int, Field(ge=1)] = 1
    target_ongoing_requests: Annotated[float, Field(gt=0)] = 2.0
    upscale_delay_s: Annotated[float, Field(ge=0)] = 30.0
    downscale_delay_s: Annotated[float, Field(ge=0)] = 600.0

    @model_validator(mode="after")
    def _check(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class InstanceGroup(_Strict):
    count: Annotated[int, Field(ge=1)] = 1
    kind: Literal["cpu", "gpu", "auto"] = "auto"
    # torch / onnxruntime intra-op threads per instance; 0 leaves the library default.
    threads: Annotated[int, Field(ge=0)] = 0
    # "thread": the model runs on a thread of the server (no copies). "process": in a
    # child process, so a crash or a kill takes down only that instance. "ray": each
    # instance is a data-parallel replica in a Ray actor, anywhere on the cluster that
    # `bitserve serve --ray ADDRESS` joins (bitserve/repository/replica.py).
    isolation: Literal["thread", "process", "ray"] = "thread"
    # A batch running longer than this marks the instance wedged: liveness fails and
    # the instance is restarted. 0 disables the check.
    execution_timeout_ms: Annotated[float, Field(ge=0)] = 60_000
    # Ray resources of each replica (isolation = "ray" only), as in Ray's
    # `ray_actor_options`. num_gpus defaults to 1 when kind = "gpu".
    num_cpus: Annotated[float, Field(ge=0)] | None = None
    num_gpus: Annotated[float, Field(ge=0)] | None = None
    # Ray replicas scaled on load (llm and batched models; count is the initial number).
    autoscaling: Autoscaling | None = None

    @model_validator(mode="before")
    @classmethod
    def _kind_is_a_device(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and raw.get("kind") == "ray":
            raise ValueError(
                'kind is the device (cpu, gpu, auto); for Ray replicas set isolation = "ray"'
            )
        return raw

    @model_validator(mode="after")
    def _check(self) -> InstanceGroup:
        ray_only = [k for k in ("num_cpus", "num_gpus") if getattr(self, k) is not None]
        if ray_only and self.isolation != "ray":
            raise ValueError(
                f'{" and ".join(ray_only)}: Ray resources, only with isolation = "ray"'
            )
        if self.autoscaling is not None and self.isolation != "ray":
            raise ValueError('autoscaling: scales Ray replicas, only with isolation = "ray"')
        if self.kind == "cpu" and self.num_gpus:
            raise ValueError('kind = "cpu" with num_gpus > 0: choose one')
        return self

    def ray_resources(self) -> dict[str, float]:
        """Each replica's Ray resources: 1 CPU unless given, a GPU when kind = "gpu"."""
        gpus = self.num_gpus if self.num_gpus is not None else (1.0 if self.kind == "gpu" else 0.0)
        return {"num_cpus": 1.0 if self.num_cpus is None else self.num_cpus, "num_gpus": gpus}


class VersionPolicy(_Strict):
    """Exactly one of `latest` (the N highest versions), `all`, or `specific`."""

    latest: Annotated[int, Field(ge=1)] | None = None
    all: bool | None = None
    specific: list[Annotated[int, Field(ge=1)]] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> VersionPolicy:
        chosen = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"give one of latest, all, specific; got {', '.join(chosen)}")
        return self

    def select(self, available: list[int]) -> list[int]:
        available = sorted(available)
        if self.all:
            return available
        if self.specific is not None:
            return sorted(v for v in self.specific if v in available)
        return available[-(self.latest or 1) :]


class WarmupInput(_Strict):
    dims: list[Annotated[int, Field(ge=1)]] = []
    zero_data: bool = False
    random_data: bool = False
    data: list[Any] | None = None  # literal values, flattened row-major


class Warmup(_Strict):
    name: str
    batch_size: Annotated[int, Field(ge=1)] = 1
    count: Annotated[int, Field(ge=1)] = 1
    inputs: dict[str, WarmupInput]


class RollbackRule(_Strict):
    """The automatic rollback: the canary's weight drops to 0 when its error rate or its
    p99 latency is significantly worse than stable's. Checked every `check_every` canary
    requests once both versions have `min_requests`; each check spends part of `alpha`
    (alpha * 6 / (pi^2 k^2) at the k-th), so repeated looks keep the false rollback rate
    at most `alpha`."""

    enabled: bool = True
    alpha: Annotated[float, Field(gt=0, lt=0.5)] = 0.01
    min_requests: Annotated[int, Field(ge=20)] = 200
    check_every: Annotated[int, Field(ge=1)] = 50


class Traffic(_Strict):
    """A model's rollout: which version answers (`stable`, and `canary` for
    `canary_weight` percent of requests) and which one sees a copy (`shadow`, for
    `shadow_percent` of stable's requests; its answers are compared and discarded)."""

    stable: Annotated[int, Field(ge=1)]
    canary: Annotated[int, Field(ge=1)] | None = None
    canary_weight: Annotated[float, Field(ge=0, le=100)] = 0.0
    shadow: Annotated[int, Field(ge=1)] | None = None
    shadow_percent: Annotated[float, Field(ge=0, le=100)] = 100.0
    # Mirrors waiting for the shadow; a full queue drops the mirror (counted).
    shadow_queue_size: Annotated[int, Field(ge=1)] = 64
    shadow_concurrency: Annotated[int, Field(ge=1)] = 2
    # Per version, the latest `window` requests feed the statistics.
    window: Annotated[int, Field(ge=100)] = 10_000
    # How to compare an output; by default BYTES is text, integers are labels and
    # floats are numeric (add "classification" for scores to compare by top-1). An output
    # named boxes [K, 4] (or declared "boxes") is compared by IoU-matched box agreement.
    compare: dict[str, Literal["numeric", "classification", "text", "boxes"]] = {}
    # The verdict: significance, power, and the smallest change worth detecting.
    alpha: Annotated[float, Field(gt=0, lt=0.5)] = 0.05
    power: Annotated[float, Field(gt=0.5, lt=1)] = 0.8
    latency_effect: Annotated[float, Field(gt=0)] = 0.10  # relative, of stable's mean
    error_effect: Annotated[float, Field(gt=0, lt=1)] = 0.01  # absolute error-rate rise
    min_cosine: Annotated[float, Field(ge=-1, le=1)] = 0.99  # shadow: mean cosine bar
    min_agreement: Annotated[float, Field(ge=0, le=1)] = 0.99  # shadow: top-1/exact bar
    rollback: RollbackRule = RollbackRule()

    @model_validator(mode="after")
    def _check(self) -> Traffic:
        if self.canary is not None and self.canary == self.stable:
            raise ValueError(f"traffic.canary {self.canary} is the stable version")
        if self.shadow is not None and self.shadow in (self.stable, self.canary):
            raise ValueError(f"traffic.shadow {self.shadow} already answers requests")
        if self.canary is None and self.canary_weight:
            raise ValueError("traffic.canary_weight needs traffic.canary")
        return self

    def versions(self) -> dict[str, int]:
        named = {"stable": self.stable, "canary": self.canary, "shadow": self.shadow}
        return {k: v for k, v in named.items() if v is not None}

    def unserved(self, served: list[int]) -> str | None:
        """Why this policy names a version the version_policy does not serve (or None)."""
        for field, number in self.versions().items():
            if number not in served:
                return (
                    f"field 'traffic.{field}': version {number} is not served; version_policy "
                    f"serves {sorted(served)} (set version_policy.all = true or specific)"
                )
        return None


class EnsembleStep(_Strict):
    """One step of an ensemble, in Triton's words: `input_map` maps each input of the
    step's model (key) to the ensemble tensor that feeds it (value), `output_map` each
    output of the model (key) to the ensemble tensor it writes (value). The tensors are
    the ensemble's inputs and outputs and every value of these maps."""

    model_name: Annotated[str, Field(min_length=1)]
    model_version: int = -1  # -1: the highest ready version, as in Triton
    input_map: dict[str, str]
    output_map: dict[str, str]


class EnsembleScheduling(_Strict):
    step: Annotated[list[EnsembleStep], Field(min_length=1)]

    def order(self, inputs: set[str], outputs: list[str]) -> list[int]:
        """The steps' indexes in an order that runs each after the steps that write its
        inputs; raises ValueError naming the step when a tensor is read that nothing
        writes, written twice, an output nobody writes, or the steps form a cycle."""
        writer: dict[str, int] = {}
        for i, step in enumerate(self.step):
            for tensor in step.output_map.values():
                if tensor in inputs or tensor in writer:
                    first = (
                        "an ensemble input" if tensor in inputs else step_name(self, writer[tensor])
                    )
                    raise ValueError(
                        f"{step_name(self, i)}: output_map writes '{tensor}', already {first}"
                    )
                writer[tensor] = i
        for i, step in enumerate(self.step):
            for tensor in step.input_map.values():
                if tensor not in inputs and tensor not in writer:
                    raise ValueError(
                        f"{step_name(self, i)}: input_map reads '{tensor}', which is neither "
                        "an ensemble input nor written by any step"
                    )
        unwritten = [name for name in outputs if name not in writer]
        if unwritten:
            raise ValueError(f"ensemble outputs {unwritten} are written by no step")
        return _topological(self, writer)


def step_name(scheduling: EnsembleScheduling, index: int) -> str:
    """How errors name a step: its 1-based place and its model."""
    return f"step {index + 1} (model '{scheduling.step[index].model_name}')"


def _topological(scheduling: EnsembleScheduling, writer: dict[str, int]) -> list[int]:
    needs = {
        i: {writer[t] for t in step.input_map.values() if t in writer}
        for i, step in enumerate(scheduling.step)
    }
    order: list[int] = []
    while len(order) < len(needs):
        ready = [i for i, deps in needs.items() if i not in order and deps <= set(order)]
        if not ready:
            stuck = [step_name(scheduling, i) for i in needs if i not in order]
            raise ValueError(f"the ensemble's steps form a cycle: {', '.join(stuck)}")
        order.extend(ready)
    return order


class ResponseCache(_Strict):
    """Triton's `response_cache { enable: true }`, per model, bounded in bytes (LRU). An
    llm model's answer is cached only when greedy (temperature 0): sampled text never."""

    enable: bool = False
    max_bytes: Annotated[int, Field(gt=0)] = 64 * 1024 * 1024


class ModelConfig(_Strict):
    name: str
    backend: Literal["python", "torch", "onnx", "hf", "llm", "detector", "diffusion", "ensemble"]
    max_batch_size: Annotated[int, Field(ge=0)] = 0
    input: list[TensorSpec] = []
    output: list[TensorSpec] = []
    dynamic_batching: DynamicBatching | None = None
    instance_group: InstanceGroup = InstanceGroup()
    version_policy: VersionPolicy = VersionPolicy()
    model_warmup: list[Warmup] = []
    # Backend-specific settings (e.g. hf: path, task, pooling).
    parameters: dict[str, Any] = {}
    # Canary and shadow rollout (bitserve/rollout); None: the highest version answers.
    traffic: Traffic | None = None
    # backend = "ensemble": the steps (bitserve/repository/paths/ensemble.py)
    ensemble_scheduling: EnsembleScheduling | None = None
    response_cache: ResponseCache = ResponseCache()

    @model_validator(mode="before")
    @classmethod
    def _llm_defaults(cls, raw: Any) -> Any:
        """An llm model speaks text: v2 infer takes `text_input` (and optional JSON
        `sampling_parameters`) and returns `text_output`, as Triton's vLLM backend."""
        if isinstance(raw, dict) and raw.get("backend") == "llm":
            raw = dict(raw)
            raw.setdefault(
                "input",
                [
                    {"name": "text_input", "datatype": "BYTES", "dims": [1]},
                    {
                        "name": "sampling_parameters",
                        "datatype": "BYTES",
                        "dims": [1],
                        "optional": True,
                    },
                ],
            )
            raw.setdefault("output", [{"name": "text_output", "datatype": "BYTES", "dims": [1]}])
        return raw

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.instance_group.autoscaling is not None and self.backend in (
            "ensemble",
            "diffusion",
        ):
            raise ValueError(
                f"instance_group.autoscaling: scales Ray replicas of llm and batched models, "
                f"not a {self.backend} model"
            )
        if self.backend == "llm" and (self.max_batch_size or self.dynamic_batching):
            raise ValueError(
                "an llm model batches in its engine: drop max_batch_size and dynamic_batching"
            )
        for kind, tensors in (("input", self.input), ("output", self.output)):
            names = [t.name for t in tensors]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"{kind} names must be unique; repeated: {duplicates}")
        if self.dynamic_batching is not None and self.max_batch_size == 0:
            raise ValueError("dynamic_batching needs max_batch_size > 0")
        for size in self.dynamic_batching.preferred_batch_sizes if self.dynamic_batching else []:
            if size > self.max_batch_size:
                raise ValueError(
                    f"preferred batch size {size} exceeds max_batch_size {self.max_batch_size}"
                )
        masks = {t.mask for t in self.input if t.mask}
        if masks & {t.name for t in self.input}:
            raise ValueError(f"mask names {sorted(masks)} collide with declared inputs")
        if any(t.labels for t in self.input):
            raise ValueError("labels name an output's classes; an input has none")
        if any(t.ragged for t in self.input) and self.max_batch_size == 0:
            raise ValueError("ragged inputs need max_batch_size > 0")
        for w in self.model_warmup:
            if w.batch_size > max(self.max_batch_size, 1):
                raise ValueError(f"warmup {w.name!r}: batch_size exceeds max_batch_size")
            unknown = set(w.inputs) - {t.name for t in self.input}
            if unknown:
                raise ValueError(f"warmup {w.name!r}: unknown inputs {sorted(unknown)}")
        return self

    @model_validator(mode="after")
    def _check_ensemble(self) -> ModelConfig:
        if (self.backend == "ensemble") != (self.ensemble_scheduling is not None):
            raise ValueError('ensemble_scheduling goes with backend = "ensemble", and only there')
        if self.backend == "diffusion" and self.response_cache.enable:
            raise ValueError("response_cache: a diffusion model's images are sampled")
        if self.ensemble_scheduling is not None:
            if self.dynamic_batching is not None:
                raise ValueError("an ensemble batches at each step's model: drop dynamic_batching")
            inputs = {t.name for t in self.input}
            self.ensemble_scheduling.order(inputs, [t.name for t in self.output])
        return self

    @model_validator(mode="after")
    def _check_traffic(self) -> ModelConfig:
        specific = self.version_policy.specific
        problem = self.traffic and specific is not None and self.traffic.unserved(specific)
        if problem:
            raise ValueError(problem)
        return self

    def input_spec(self, name: str) -> TensorSpec | None:
        return next((t for t in self.input if t.name == name), None)

    def full_shape(self, spec: TensorSpec) -> list[int]:
        """The shape a client sees: the batch dimension (-1) first when batching."""
        return ([-1] if self.max_batch_size > 0 else []) + list(spec.dims)


def version_numbers(model_dir: Path) -> list[int]:
    """The model's numeric version folders (`1/`, `2/`, ...), in order."""
    return sorted(
        int(p.name)
        for p in model_dir.iterdir()
        if p.is_dir() and p.name.isdigit() and not p.name.startswith("0")
    )


def load_config(path: Path) -> ModelConfig:
    """Read and validate `path`; the model name defaults to the folder's name."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e
    raw.setdefault("name", path.parent.name)
    if raw["name"] != path.parent.name:
        raise ConfigError(
            f"{path}: field 'name': {raw['name']!r} differs from the folder name "
            f"{path.parent.name!r}"
        )
    try:
        config = ModelConfig.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '(root)'}': {err['msg']}"
            for err in e.errors()
        )
        raise ConfigError(f"{path}: {problems}") from None
    for i, spec in enumerate(config.output):
        if spec.labels is not None and not (path.parent / spec.labels).is_file():
            raise ConfigError(f"{path}: field 'output.{i}.labels': no file {spec.labels!r}")
    return config
