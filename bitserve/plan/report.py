"""What `bitserve plan` prints: tables and the reasoning behind each answer."""

from __future__ import annotations

import math

import numpy as np


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in rows]  # fmt: skip
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def memory_table(model, plan, opts: dict) -> str:
    width = 4 if opts["kv_dtype"] == "float32" else 2
    per_token = model.kv_bytes_per_token(width)
    head = (
        f"{model.family}: {model.params() / 1e6:.2f}M parameters, {model.layers} layers, "
        f"{model.kv_heads} kv heads x {model.head_dim} dims; KV {per_token} B/token "
        f"(2 x {model.layers} x {model.kv_heads} x {model.head_dim} x {width} B)\n"
        f"{opts['max_seqs']} sequences x {opts['context']} tokens, blocks of {opts['block_size']}: "
        f"{plan.num_blocks} blocks"
    )
    rows = [["part", "bytes", ""],
            ["weights" + (f" ({opts['quant']})" if opts["quant"] else f" ({opts['dtype']})"),
             gib(plan.weights), ""],
            ["KV cache", gib(plan.kv_cache), opts["kv_dtype"]],
            ["KV pool alignment", gib(plan.kv_padding), "2 MiB per pool"],
            ["rotary tables", gib(plan.tables), ""],
            ["activations", gib(plan.activations), "estimate, peak of one step"],
            ["total", gib(plan.total), ""]]  # fmt: skip
    return head + "\n" + table(rows)


def memory_check(plan, measured: dict) -> str:
    error = plan.static / measured["total"] - 1
    return (
        f"engine built at this size holds {gib(measured['total'])} "
        f"(KV {gib(measured['kv_cache'])}, rest {gib(measured['other'])}, "
        f"{measured['num_blocks']} blocks); estimate without activations "
        f"{gib(plan.static)}: {error:+.1%}"
    )


def hardware_table(plans, work) -> str:
    from bitserve.plan.hardware import cost_per_million_tokens

    rows = [["shape", "fits", "need/mem", "tok/s@1", "prefill ms", "batch", "tok/s@batch",
             "replicas", "$/h", "$/1M tok", "verdict"]]  # fmt: skip
    for p in plans:
        cost = cost_per_million_tokens(p, work) if p.meets_slo else None
        rows.append([
            p.shape.name, "yes" if p.fits else "no",
            f"{gib(p.needed or p.weights)}/{gib(p.shape.memory)}",
            _num(p.decode_tok_s), _num(p.prefill_s * 1e3), str(p.batch or "-"),
            _num(p.batch_tok_s), str(p.replicas or "-"),
            _num(p.cost_per_hour, "{:.2f}"), _num(cost, "{:.3f}"), p.why,
        ])  # fmt: skip
    return table(rows)


def _num(value, spec: str = "{:.1f}") -> str:
    return "-" if value is None or not math.isfinite(value) or value == 0 else spec.format(value)


def recommendation(plans, best, work) -> str:
    """The pick and why: the cheapest per hour of those that meet the SLO, and what the
    cheaper ones lacked."""
    if best is None:
        return "no priced shape fits and meets the SLO: relax the SLO, quantize (--quant), or shard"
    lines = [f"recommended: {best.shape.name} x {best.replicas} = ${best.cost_per_hour:.2f}/h"]
    lines.append(
        f"  because: it fits ({gib(best.needed)} of {gib(best.shape.memory)}), decodes one "
        f"sequence at {best.decode_tok_s:.0f} tok/s ({best.tpot_s * 1e3:.1f} ms/token <= "
        f"{work.tpot_s * 1e3:.0f}), prefills {work.input_len} tokens in "
        f"{best.prefill_s * 1e3:.0f} ms (<= {work.ttft_s * 1e3:.0f}), batches {best.batch} "
        f"sequences within the TPOT SLO, and {best.replicas} replica(s) serve {work.rate:g} "
        f"req/s at <= 80% busy"
    )
    cheaper = [p for p in plans if p.shape.price_per_hour is not None
               and p.shape.price_per_hour < best.cost_per_hour and p is not best]  # fmt: skip
    for p in cheaper:
        reason = (
            p.why if not p.meets_slo else f"needs {p.replicas} replicas = ${p.cost_per_hour:.2f}/h"
        )
        lines.append(f"  not {p.shape.name}: {reason}")
    return "\n".join(lines)


def fit_table(title: str, sample, fits) -> str:
    data = np.asarray(sample, dtype=float)
    head = (f"{title}: n={len(data)}, mean {data.mean():.4g}, median {np.median(data):.4g}, "
            f"p99 {np.percentile(data, 99):.4g}")  # fmt: skip
    rows = [["family", "parameters (95% CI)", "log L", "AIC", "dAIC", "KS D", "KS p"]]
    for f in fits:
        params = ", ".join(
            f"{k}={v:.4g} [{f.interval(k)[0]:.4g}, {f.interval(k)[1]:.4g}]"
            for k, v in f.params.items()
        )
        numbers = (f.log_likelihood, f.aic, f.aic - fits[0].aic, f.ks_statistic, f.ks_p_value)
        specs = ("{:.1f}", "{:.1f}", "{:.1f}", "{:.4f}", "{:.3g}")
        rows.append([f.family, params, *(s.format(v) for s, v in zip(specs, numbers, strict=True))])
    return head + "\n" + table(rows)


def capacity_header(profile, arrivals, batching) -> str:
    policy = batching.policy
    rules = (f"max_batch_size {batching.max_batch_size}, max_queue_delay_ms "
             f"{policy.max_queue_delay_ms:g}, preferred {policy.preferred_batch_sizes}"
             if policy else "no dynamic batching")  # fmt: skip
    return (
        f"arrivals: {arrivals.family} renewal process at {arrivals.rate:.2f} req/s\n"
        f"batch time: {profile.base_ms:.2f} + {profile.per_row_ms:.2f} x rows ms, "
        f"+ {profile.overhead_ms:.2f} ms outside the batcher\n"
        f"batcher: {rules}, {batching.instances} instance(s) per replica"
    )


def capacity_result(tried, needed, slo_ms: float) -> str:
    lines = [f"  {n} replica(s): simulated p99 {p99:.1f} ms" for n, p99 in tried]
    if needed is None:
        lines.append(f"no replica count up to {tried[-1][0]} keeps p99 under {slo_ms:g} ms")
    else:
        lines.append(f"replicas needed: {needed} (p99 {tried[-1][1]:.1f} ms <= {slo_ms:g} ms)")
    return "\n".join(lines)


def validation(check: dict) -> str:
    ratio = check["simulated_p99_ms"] / check["measured_p99_ms"]
    return (f"validation at {check['load']}: measured p99 {check['measured_p99_ms']:.1f} ms, "
            f"simulated {check['simulated_p99_ms']:.1f} ms ({ratio - 1:+.0%})")  # fmt: skip
