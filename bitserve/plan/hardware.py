"""Right-sizing: for each instance shape, does the model fit, how fast does it run by
the roofline, how many replicas does the traffic need, and what does a token cost.

Decode is memory-bound: each step reads every weight once plus the KV of every running
sequence, so a step takes max(bytes / bandwidth, FLOPs / peak) and batching B sequences
shares the weight read (B tokens per step for little more time). Prefill is
compute-bound: 2 x active weights FLOPs per prompt token plus causal attention. Vendor
peaks are not reached, so they are discounted by an efficiency; a `bitserve bench`
result from this machine replaces the guess for CPU shapes with a measured factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from bitserve.plan import memory
from bitserve.plan.catalogue import Shape
from bitserve.plan.shape import ModelShape

MAX_BATCH = 256  # the engine's default max_num_seqs
MEMORY_HEADROOM = 0.9  # leave a tenth for the runtime, fragmentation, the OS
TARGET_UTILIZATION = 0.8  # size replicas for 80% busy: queues explode near 100%


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak bandwidth and FLOP/s the engine reaches."""

    bandwidth: float = 0.7
    flops: float = 0.5


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second
    input_len: int = 512
    output_len: int = 128
    ttft_s: float = 0.5
    tpot_s: float = 0.05
    quant: str | None = None


@dataclass
class ShapePlan:
    shape: Shape
    fits: bool
    weights: int = 0
    needed: int = 0  # weights + one sequence's KV + activations
    tpot_s: float = math.inf  # one sequence decoding alone
    prefill_s: float = math.inf
    batch: int = 0  # sequences decoded together within the TPOT SLO and memory
    batch_tok_s: float = 0.0
    replicas: int = 0
    meets_slo: bool = False
    why: str = ""

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.tpot_s if self.tpot_s > 0 else 0.0

    @property
    def cost_per_hour(self) -> float | None:
        price = self.shape.price_per_hour
        return None if price is None or not self.replicas else price * self.replicas


def dtypes(shape: Shape) -> tuple[str, str]:
    """(weight dtype, KV dtype): GPUs keep both in 16 bits; bitserve's CPU engine keeps
    KV in fp32 (bf16 attention is several times slower than fp32 on CPU)."""
    return shape.dtype, "float32" if shape.kind == "cpu" else shape.dtype


def step_time(
    model: ModelShape, shape: Shape, eff: Efficiency, batch: int, context: int, weights: int
) -> float:
    """One decode step of `batch` sequences of `context` tokens: the roofline maximum."""
    dtype, kv_dtype = dtypes(shape)
    kv = batch * context * model.kv_bytes_per_token(memory.DTYPE_BYTES[kv_dtype])
    attention = 4 * model.layers * context * model.heads * model.head_dim
    flops = batch * (model.flops_per_token() + attention)
    return max(
        (weights + kv) / (shape.bandwidth * eff.bandwidth), flops / (shape.flops(dtype) * eff.flops)
    )


def prefill_time(
    model: ModelShape, shape: Shape, eff: Efficiency, tokens: int, weights: int
) -> float:
    """A whole prompt in one pass: compute-bound, but never faster than one weight read."""
    attention = 2 * model.layers * tokens * tokens * model.heads * model.head_dim
    flops = tokens * model.flops_per_token() + attention
    return max(
        flops / (shape.flops(shape.dtype) * eff.flops), weights / (shape.bandwidth * eff.bandwidth)
    )


def max_batch(model: ModelShape, shape: Shape, work: Workload, weights: int) -> int:
    """How many sequences of input+output tokens fit beside the weights and activations."""
    _, kv_dtype = dtypes(shape)
    context = work.input_len + work.output_len
    per_seq = context * model.kv_bytes_per_token(memory.DTYPE_BYTES[kv_dtype])
    act = memory.activation_bytes(model, 1, context, min(context, 2048))
    room = shape.memory * MEMORY_HEADROOM - weights - act
    return max(0, min(MAX_BATCH, int(room // per_seq)))


def plan_shape(model: ModelShape, shape: Shape, work: Workload, eff: Efficiency) -> ShapePlan:
    weights = memory.weight_bytes(model, shape.dtype, work.quant)
    fits_batch = max_batch(model, shape, work, weights)
    if fits_batch < 1:
        return ShapePlan(shape, False, weights, why="does not fit in memory")
    mid = work.input_len + work.output_len // 2  # mean context while decoding
    plan = ShapePlan(shape, True, weights, needed=shape_need(model, shape, work, weights))
    plan.tpot_s = step_time(model, shape, eff, 1, mid, weights)
    plan.prefill_s = prefill_time(model, shape, eff, work.input_len, weights)
    plan.batch = largest_batch(model, shape, eff, fits_batch, mid, weights, work.tpot_s)
    if plan.batch:
        plan.batch_tok_s = plan.batch / step_time(model, shape, eff, plan.batch, mid, weights)
    plan.meets_slo = plan.batch > 0 and plan.prefill_s <= work.ttft_s
    plan.why = slo_verdict(plan, work)
    if plan.meets_slo:
        per_request = plan.prefill_s + work.output_len / plan.batch_tok_s
        plan.replicas = math.ceil(work.rate * per_request / TARGET_UTILIZATION)
    return plan


def shape_need(model: ModelShape, shape: Shape, work: Workload, weights: int) -> int:
    _, kv_dtype = dtypes(shape)
    context = work.input_len + work.output_len
    kv = context * model.kv_bytes_per_token(memory.DTYPE_BYTES[kv_dtype])
    return weights + kv + memory.activation_bytes(model, 1, context, min(context, 2048))


def largest_batch(model, shape, eff, limit: int, context: int, weights: int, tpot_s: float) -> int:
    """The biggest batch whose decode step still meets the TPOT SLO (0 if none does);
    step time grows with the batch, so a binary search finds it."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_time(model, shape, eff, mid, context, weights) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def slo_verdict(plan: ShapePlan, work: Workload) -> str:
    if plan.prefill_s > work.ttft_s:
        return f"prefill {plan.prefill_s * 1e3:.0f} ms > TTFT SLO {work.ttft_s * 1e3:.0f} ms"
    if plan.batch == 0:
        return f"decode step {plan.tpot_s * 1e3:.1f} ms > TPOT SLO {work.tpot_s * 1e3:.0f} ms"
    return "meets the SLO"


def cost_per_million_tokens(plan: ShapePlan, work: Workload) -> float | None:
    """At the offered rate (not at full load): idle capacity is paid for too."""
    hourly = plan.cost_per_hour
    if hourly is None or work.rate <= 0:
        return None
    tokens_per_hour = work.rate * (work.input_len + work.output_len) * 3600
    return hourly / tokens_per_hour * 1e6


def efficiency_for(shape: Shape, default: Efficiency, calibration: Efficiency | None) -> Efficiency:
    """Measured shapes reach their own figures; vendor peaks get the default discount;
    a calibration (engine / roofline on this machine) scales CPU shapes further."""
    base = Efficiency(1.0, 1.0) if shape.measured else default
    if calibration is None or shape.kind != "cpu":
        return base
    return replace(
        base, bandwidth=base.bandwidth * calibration.bandwidth, flops=base.flops * calibration.flops
    )


def plan_all(
    model: ModelShape, shapes: list[Shape], work: Workload, calibration=None
) -> list[ShapePlan]:
    default = Efficiency()
    return [plan_shape(model, s, work, efficiency_for(s, default, calibration)) for s in shapes]


def recommend(plans: list[ShapePlan]) -> ShapePlan | None:
    """The cheapest per hour among priced shapes that fit and meet the SLO."""
    ok = [p for p in plans if p.meets_slo and p.cost_per_hour is not None]
    return min(ok, key=lambda p: p.cost_per_hour, default=None)
