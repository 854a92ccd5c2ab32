"""What tracing costs: HTTP/JSON on mlp with tracing off, against the same server
without the tracing code (a baseline tree, e.g. main), and with tracing on.

    .venv-bench/bin/python -m bench.tracing --baseline /work/main [--duration 5] [--rounds 3]

Three `bitserve serve` processes on one repository, each pinned to the server core
(only one is loaded at a time): `baseline`, the tree given by --baseline; `off`, this
tree as served by default; `on`, this tree with --otlp-traces-endpoint pointing at an
OTLP/gRPC receiver this process runs (it counts the spans it is sent). Each point is
bench.grpc's HTTP/JSON closed loop of --concurrency users (bitserve's load generator)
on the client core; the servers alternate for --rounds rounds and the ratios use the
mean, so a shared box's drift hits all three alike. Prints a table and a final JSON
line, also written to bench/results/tracing.json. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path

from bench.batching import mlp_repo
from bench.grpc import http_point, mlp_bodies
from bench.server import Server, bitserve_command, free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "tracing.json"


def receiver() -> tuple[object, str, list]:
    """An OTLP/gRPC trace receiver on a free port: (server, endpoint, span counter)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    count, lock = [0], threading.Lock()

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # the proto's name
            spans = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            with lock:
                count[0] += spans
            return trace_service_pb2.ExportTraceServiceResponse()

    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, f"http://127.0.0.1:{port}", count


def servers(repo: Path, baseline: Path, endpoint: str, cpus: set) -> dict[str, Server]:
    """The three servers, not started: baseline runs from its own tree (`python -m`
    imports the package of the folder it runs in)."""
    port = free_port()
    base = ["env", "-C", str(baseline), *bitserve_command(repo, port)]
    return {
        "baseline": Server("bitserve baseline", base, port, cpus=cpus),
        "off": Server.bitserve(repo, cpus=cpus),
        "on": Server.bitserve(repo, "--otlp-traces-endpoint", endpoint, cpus=cpus),
    }


def run(cfg: argparse.Namespace) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus, client_cpus = {cpus[-1]}, set(cpus[:-1]) or {cpus[0]}
    os.sched_setaffinity(0, client_cpus)
    collector, endpoint, spans = receiver()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        source = mlp_repo(repo)
        bodies, _ = mlp_bodies()
        started = servers(repo, cfg.baseline.resolve(), endpoint, server_cpus)
        try:
            for server in started.values():
                server.start()
                http_point(server.port, "mlp", bodies, cfg.concurrency, cfg.warmup)
            for round_ in range(cfg.rounds):
                for name, server in started.items():
                    row = {"server": name, "round": round_ + 1}
                    point = http_point(server.port, "mlp", bodies, cfg.concurrency, cfg.duration)
                    row.update(
                        {k: round(v, 2) if isinstance(v, float) else v for k, v in point.items()}
                    )
                    rows.append(row)
                    print(
                        f"{name:8} round {row['round']}  {row['rps']:9.1f} req/s  "
                        f"p50 {row['p50_ms']} ms  p99 {row['p99_ms']} ms  errors {row['errors']}",
                        flush=True,
                    )
        finally:
            for server in started.values():
                server.stop()
            collector.stop(0)
    mean = {n: statistics.mean(r["rps"] for r in rows if r["server"] == n) for n in started}
    spread = {
        n: [
            min(r["rps"] for r in rows if r["server"] == n),
            max(r["rps"] for r in rows if r["server"] == n),
        ]
        for n in started
    }
    return {
        "bench": "tracing",
        "source": source,
        "baseline": str(cfg.baseline),
        "concurrency": cfg.concurrency,
        "duration_s": cfg.duration,
        "rounds": cfg.rounds,
        "load_average": os.getloadavg()[0],
        "rows": rows,
        "mean_rps": {n: round(v, 1) for n, v in mean.items()},
        "spread_rps": spread,
        "off_over_baseline": round(mean["off"] / mean["baseline"], 3),
        "on_over_baseline": round(mean["on"] / mean["baseline"], 3),
        "spans_received": spans[0],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, required=True, help="a bitserve tree without tracing")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    result = run(p.parse_args(argv))
    print(
        f"\noff / baseline {result['off_over_baseline']}, on / baseline "
        f"{result['on_over_baseline']} ({result['spans_received']} spans received)"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
