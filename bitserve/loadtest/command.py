"""`bitserve bench`: measure throughput and latency of a v2 or OpenAI server.

bitserve bench http://127.0.0.1:8000 --model minilm --concurrency 1,8,64
bitserve bench URL --model m --api chat --rate 2,8 --burstiness 0.5 --goodput ttft:500 tpot:50
bitserve bench compare a/result.json b/result.json
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import click

from bitserve.loadtest import loadgen, metrics, report, server_view, workloads


class DefaultGroup(click.Group):
    """`bitserve bench URL ...` runs a benchmark; `bitserve bench compare ...` compares.

    Also lets `--goodput ttft:500 tpot:50` be written as in `vllm bench serve`: the
    values after --goodput become repeated options before click parses them.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = _expand_goodput(args)
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def _expand_goodput(args: list[str]) -> list[str]:
    out, in_goodput = [], False
    for arg in args:
        if in_goodput and re.fullmatch(r"(ttft|tpot|e2el):[\d.]+", arg) and out[-1] != "--goodput":
            out.append("--goodput")
        in_goodput = arg == "--goodput" or (in_goodput and not arg.startswith("-"))
        out.append(arg)
    return out


@click.group(cls=DefaultGroup)
def bench() -> None:
    """Benchmark a server: throughput against latency (run `bitserve bench run --help`)."""


def _csv(kind):
    return lambda ctx, param, value: [kind(v) for v in value.split(",")] if value else []


@bench.command("run")
@click.argument("url")
@click.option("--model", required=True, help="Model name (v2 path / OpenAI `model`).")
@click.option(
    "--api", type=click.Choice(["v2", "completions", "chat"]), default="v2", show_default=True
)
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL: v2 bodies (v2) or {prompt, output_len} (OpenAI).",
)
@click.option("--path", "path_override", help="v2/JSONL: POST here instead of /v2/models/M/infer.")
@click.option("--concurrency", callback=_csv(int), help="Closed loop sweep, e.g. 1,8,64.")
@click.option("--rate", callback=_csv(float), help="Open loop sweep in req/s, e.g. 1,4,inf.")
@click.option("--burstiness", default=1.0, show_default=True, help="Gamma shape; 1 = Poisson.")
@click.option("--max-concurrency", type=int, help="Open loop: cap on requests in flight.")
@click.option(
    "--num-requests", type=int, help="Requests per point (default 200 without --duration)."
)
@click.option("--duration", type=float, help="Seconds per point; nothing is sent after it.")
@click.option(
    "--warmup", default=0, show_default=True, help="Unmeasured requests before each point."
)
@click.option("--timeout", default=60.0, show_default=True, help="Seconds per request.")
@click.option("--batch-size", default=1, show_default=True, help="v2: rows per request.")
@click.option("--input-len", default=128, show_default=True)
@click.option("--output-len", default=128, show_default=True)
@click.option(
    "--length-dist", type=click.Choice(["random", "fixed"]), default="random", show_default=True
)
@click.option("--range-ratio", default=0.5, show_default=True, help="random: len*(1±r).")
@click.option("--prefix-len", default=0, show_default=True, help="Shared prefix words per prompt.")
@click.option("--num-prefixes", default=1, show_default=True)
@click.option("--ignore-eos", is_flag=True)
@click.option("--no-stream", is_flag=True, help="OpenAI: ask for whole answers.")
@click.option("--goodput", multiple=True, help="SLOs in ms: ttft:500 tpot:50 e2el:1000.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--report-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-report"),
    show_default=True,
)
@click.option("--no-plots", is_flag=True)
@click.option("--no-progress", is_flag=True)
@click.option("--allow-remote", is_flag=True, help="Allow a target that is not loopback.")
def run_command(url: str, **opts) -> None:
    """Run a sweep against URL; write result.json, the table and plots to --report-dir."""
    try:
        check_target(url, opts["allow_remote"])
        slos = metrics.parse_goodput([g for item in opts["goodput"] for g in item.split()])
        loads = make_loads(opts)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    requests = make_requests(url, opts, loads)
    result = {"config": config(url, opts), "points": []}
    for load in loads:
        result["points"].append(run_point(url, requests, load, slos, opts))
    folder = opts["report_dir"]
    click.echo(report.table(result["points"]))
    path = report.write_json(result, folder)
    pictures = [] if opts["no_plots"] else report.plots(result, folder)
    click.echo(f"wrote {path}" + "".join(f", {p}" for p in pictures), err=True)


@bench.command("compare")
@click.argument("a", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("b", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def compare_command(a: Path, b: Path) -> None:
    """Side by side: each load point's headline metrics in A and B, and B/A."""
    click.echo(f"a: {a}\nb: {b}")
    click.echo(report.compare(json.loads(a.read_text()), json.loads(b.read_text())))


def check_target(url: str, allow_remote: bool) -> None:
    """A load generator aimed at someone else's server is an attack: loopback only,
    unless the user says otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{url}: an http:// URL is needed (no TLS)")
    if allow_remote:
        return
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, parts.port or 80)}
    except OSError as e:
        raise ValueError(f"{parts.hostname}: {e}") from e
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(f"{parts.hostname} is not a loopback address; pass --allow-remote")


def make_loads(opts: dict) -> list[loadgen.Load]:
    if opts["concurrency"] and opts["rate"]:
        raise ValueError("sweep --concurrency or --rate, not both")
    num = opts["num_requests"]
    if num is None and opts["duration"] is None:
        num = 200
    common = dict(
        num_requests=num, duration=opts["duration"], timeout=opts["timeout"], seed=opts["seed"]
    )
    if opts["rate"]:
        return [
            loadgen.Load(
                rate=r,
                burstiness=opts["burstiness"],
                max_concurrency=opts["max_concurrency"],
                **common,
            )
            for r in opts["rate"]
        ]
    return [loadgen.Load(concurrency=c, **common) for c in opts["concurrency"] or [1]]


def make_requests(url: str, opts: dict, loads: list[loadgen.Load]) -> list[workloads.Request]:
    host = urlsplit(url).netloc
    model = opts["model"]
    if opts["api"] == "v2":
        path = opts["path_override"] or f"/v2/models/{model}/infer"
        if opts["dataset"]:
            return workloads.jsonl_requests(host, path, opts["dataset"])
        if opts["path_override"]:
            raise click.UsageError("--path needs --dataset (bodies for that endpoint)")
        metadata = fetch_json(url.rstrip("/") + f"/v2/models/{model}")
        return workloads.v2_requests(
            host, model, metadata, seed=opts["seed"], batch=opts["batch_size"]
        )
    lengths = workloads.Lengths(
        opts["input_len"], opts["output_len"], opts["length_dist"], opts["range_ratio"]
    )
    spec = workloads.OpenAIOptions(
        model=model,
        api=opts["api"],
        lengths=lengths,
        dataset=opts["dataset"],
        prefix_len=opts["prefix_len"],
        num_prefixes=opts["num_prefixes"],
        ignore_eos=opts["ignore_eos"],
        stream=not opts["no_stream"],
    )
    n = max(load.num_requests or 1000 for load in loads) + opts["warmup"]
    return workloads.openai_requests(host, spec, n, seed=opts["seed"])


def fetch_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return json.loads(answer.read())
    except OSError as e:
        raise click.ClickException(f"GET {url}: {e}") from e


def run_point(url: str, requests: list, load: loadgen.Load, slos: dict, opts: dict) -> dict:
    """Warm up, scrape, run with a progress bar, scrape again, summarise."""
    from tqdm import tqdm

    if warm := opts["warmup"]:
        # Warm up on the last requests, measure from the first: a prompt seen in the
        # warm-up would be a prefix-cache hit and flatter TTFT.
        users = load.concurrency or load.max_concurrency or 8
        spare = requests[-warm:] if len(requests) > warm else requests
        loadgen.run(url, spare, loadgen.Load(concurrency=users, num_requests=warm))
        requests = requests[:-warm] if len(requests) > warm else requests
    before = server_view.scrape(url, opts["model"])
    total = load.num_requests
    with tqdm(
        total=total,
        desc=load.label,
        unit="req",
        file=sys.stderr,
        disable=opts["no_progress"],
        leave=False,
    ) as bar:
        run = loadgen.run(url, requests, load, on_result=lambda _: bar.update())
    summary = metrics.summarise(run, slos)
    summary["server"] = server_view.difference(before, server_view.scrape(url, opts["model"]))
    summary["samples"] = metrics.samples(run)
    return summary


def config(url: str, opts: dict) -> dict:
    """What the JSON needs to say to be reproduced: every option, the time, the client."""
    workload = opts["api"] + (" (JSONL)" if opts["dataset"] else "")
    plain = {k: (str(v) if isinstance(v, Path) else v) for k, v in opts.items()}
    return {"url": url, "workload": workload, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **plain}
