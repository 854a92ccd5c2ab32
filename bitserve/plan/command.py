"""`bitserve plan`: memory, hardware, fit, capacity.

bitserve plan memory MODEL_DIR --max-seqs 64 --context 4096 [--quant int8] [--check]
bitserve plan hardware MODEL_DIR --rate 5 --slo ttft:500,tpot:50 [--bench result.json]
bitserve plan fit ACCESS_LOG [--model m] [--report-dir plan-report]
bitserve plan capacity --profile result.json --fit fit.json --slo 200 [--rate 50]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from bitserve.plan import report

EXISTING = click.Path(exists=True, path_type=Path)


@click.group()
def plan() -> None:
    """Size a deployment: memory, hardware, traffic fits and replica count."""


@plan.command("memory")
@click.argument("model_dir", type=EXISTING)
@click.option("--max-seqs", default=1, show_default=True, help="Sequences held at once.")
@click.option("--context", type=int, help="Tokens per sequence [default: max positions].")
@click.option("--quant", type=click.Choice(["int8", "int4"]), help="Quantized linear weights.")
@click.option("--dtype", default="float32", show_default=True, help="Weight dtype.")
@click.option("--kv-dtype", default="float32", show_default=True, help="CPU engine: fp32.")
@click.option("--block-size", default=16, show_default=True)
@click.option("--check", is_flag=True, help="Build the engine at this size and compare.")
def memory_command(model_dir: Path, check: bool, **opts) -> None:
    """Weights, KV cache and activations of an LLM from its config.json."""
    from bitserve.plan import memory, shape

    model = shape.from_config(shape.read_config(model_dir))
    opts["context"] = opts["context"] or model.max_positions
    estimate = memory.estimate(model, **opts)
    click.echo(report.memory_table(model, estimate, opts))
    if check:
        if opts["dtype"] != "float32" or opts["kv_dtype"] != "float32":
            raise click.UsageError("--check builds the fp32 CPU engine: drop --dtype/--kv-dtype")
        with tempfile.TemporaryDirectory(prefix="bitserve-plan-") as tmp:
            built = model_dir
            if opts["quant"]:  # measure what `bitserve quantize` really writes
                built = Path(tmp) / opts["quant"]
                command = [sys.executable, "-m", "bitserve.cli", "quantize", str(model_dir)]
                command += [str(built), "--method", opts["quant"]]
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            measured = memory.measure(built, opts["max_seqs"], opts["context"])
        click.echo(report.memory_check(estimate, measured))


@plan.command("hardware")
@click.argument("model_dir", type=EXISTING)
@click.option("--rate", type=float, required=True, help="Requests per second to serve.")
@click.option("--slo", default="ttft:500,tpot:50", show_default=True, help="ms.")
@click.option("--input-len", default=512, show_default=True, help="Prompt tokens.")
@click.option("--output-len", default=128, show_default=True, help="Generated tokens.")
@click.option("--quant", type=click.Choice(["int8", "int4"]))
@click.option("--bench", "bench_result", type=EXISTING, help="bench result.json from here.")
@click.option("--catalogue", type=EXISTING, help="Another catalogue TOML.")
def hardware_command(model_dir: Path, rate: float, slo: str, bench_result, catalogue, **opts):
    """Which instance shape serves MODEL_DIR at --rate within the SLO, cheapest."""
    from bitserve.plan import calibration, hardware, shape
    from bitserve.plan import catalogue as cat

    model = shape.from_config(shape.read_config(model_dir))
    slos = parse_slo(slo)
    work = hardware.Workload(rate, ttft_s=slos["ttft"] / 1e3, tpot_s=slos["tpot"] / 1e3, **opts)
    shapes = cat.load(catalogue) if catalogue else cat.load()
    calibrated, note = None, "not calibrated (pass --bench result.json from this machine)"
    if bench_result:
        here = next((s for s in shapes if s.measured), None)
        if here is None:
            raise click.UsageError("the catalogue has no measured shape to calibrate against")
        calibrated, note = calibration.calibrate(bench_result, model, here)
    plans = hardware.plan_all(model, shapes, work, calibrated)
    click.echo(report.hardware_table(plans, work))
    click.echo(note)
    click.echo(report.recommendation(plans, hardware.recommend(plans), work))


def parse_slo(text: str) -> dict[str, float]:
    """'ttft:500,tpot:50' -> {'ttft': 500.0, 'tpot': 50.0}; both are needed."""
    out = {}
    for item in text.replace(" ", ",").split(","):
        if item:
            name, _, value = item.partition(":")
            out[name] = float(value)
    if set(out) != {"ttft", "tpot"}:
        raise click.UsageError(f"--slo {text!r}: give ttft:MS,tpot:MS")
    return out


@plan.command("fit")
@click.argument("access_log", type=EXISTING)
@click.option("--model", help="Only this model's requests.")
@click.option("--report-dir", type=click.Path(path_type=Path), default=Path("plan-report"))
@click.option("--no-plots", is_flag=True)
def fit_command(access_log: Path, model: str | None, report_dir: Path, no_plots: bool) -> None:
    """Fit inter-arrival times and latencies of ACCESS_LOG by maximum likelihood."""
    from bitserve.plan import accesslog, fit, fitplots

    records = accesslog.read(access_log, model)
    series = {
        "inter-arrival (s)": (accesslog.inter_arrivals(records), fit.ARRIVAL_FAMILIES),
        "latency (ms)": (accesslog.latencies_ms(records), fit.LATENCY_FAMILIES),
    }
    saved = {"source": str(access_log), "model": model, "requests": len(records)}
    for (title, (sample, families)), key in zip(
        series.items(), ("arrivals", "latency"), strict=True
    ):
        fits = fit.fit_all(sample, families)
        click.echo(report.fit_table(title, sample, fits))
        if (warning := fit.warning(fits)) is not None:
            click.echo(f"WARNING: {warning}")
        saved[key] = {"n": len(sample), "fits": [f.to_dict() for f in fits]}
        if not no_plots:
            click.echo(f"wrote {fitplots.plot(sample, fits, title, report_dir / f'{key}.png')}")
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "fit.json").write_text(json.dumps(saved, indent=1) + "\n")
    click.echo(f"wrote {report_dir / 'fit.json'}")


@plan.command("capacity")
@click.option("--profile", "profile_path", type=EXISTING, required=True,
              help="Batch latency profile: bench result.json or an access log.")  # fmt: skip
@click.option("--fit", "fit_path", type=EXISTING, help="fit.json of `plan fit` (arrivals).")
@click.option("--rate", type=float, help="Requests/s (rescales the fit; Poisson without it).")
@click.option("--slo", "slo_ms", type=float, required=True, help="p99 latency SLO in ms.")
@click.option("--model-config", type=EXISTING, help="The model's config.toml (batching).")
@click.option("--max-batch-size", type=int, default=1, show_default=True)
@click.option("--max-queue-delay-ms", type=float, default=0.0, show_default=True)
@click.option("--instances", type=int, default=1, show_default=True)
@click.option("--validate", type=EXISTING, help="bench result.json of an open-loop run.")
@click.option("--requests", default=20000, show_default=True, help="Simulated per replica.")
def capacity_command(profile_path, fit_path, rate, slo_ms, validate, requests, **batching):
    """How many replicas keep p99 latency under --slo, by simulating the batcher."""
    from bitserve.plan import capacity

    profile = capacity.load_profile(profile_path)
    arrivals = make_arrivals(fit_path, rate)
    policy = make_batching(**batching)
    click.echo(report.capacity_header(profile, arrivals, policy))
    tried, needed = capacity.replicas_needed(arrivals, profile, policy, slo_ms, requests=requests)
    click.echo(report.capacity_result(tried, needed, slo_ms))
    if validate:
        click.echo(report.validation(validate_run(validate, profile, policy)))


def make_arrivals(fit_path: Path | None, rate: float | None):
    from bitserve.plan import capacity

    if fit_path is None:
        if rate is None:
            raise click.UsageError("give --fit (a fitted arrival process) or --rate (Poisson)")
        return capacity.Arrivals("exponential", {"scale": 1 / rate})
    best = json.loads(fit_path.read_text())["arrivals"]["fits"][0]
    return capacity.Arrivals(best["family"], best["params"], rate)


def make_batching(model_config, max_batch_size, max_queue_delay_ms, instances):
    """From config.toml when given (the server's own rules), else from the options."""
    from bitserve.config import DynamicBatching, load_config
    from bitserve.plan.capacity import Batching

    if model_config is not None:
        config = load_config(model_config)
        count = config.instance_group.count
        return Batching(max(config.max_batch_size, 1), config.dynamic_batching, count)
    policy = DynamicBatching(max_queue_delay_ms=max_queue_delay_ms) if max_batch_size > 1 else None
    return Batching(max_batch_size, policy, instances)


def validate_run(path: Path, profile, policy) -> dict:
    """Simulate the bench run's own load (rate, burstiness) and compare p99 with it."""
    from bitserve.plan import capacity

    result = json.loads(path.read_text())
    config = result["config"]
    point = next(p for p in result["points"] if p["load"].startswith("rate="))
    rate = float(point["load"].removeprefix("rate="))
    shape = float(config.get("burstiness", 1.0))
    arrivals = capacity.Arrivals("gamma", {"shape": shape, "scale": 1 / (rate * shape)})
    simulated = capacity.p99_ms(arrivals, profile, policy)
    return {"load": point["load"], "measured_p99_ms": point["e2el"]["p99_ms"],
            "simulated_p99_ms": simulated}  # fmt: skip
