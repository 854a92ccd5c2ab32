"""The `bitserve` command."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import click

from bitserve import __version__


def _size(text: str) -> int:
    """Parse '64MiB', '1GiB', '1048576' into bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


# Subcommands that live with their concept, imported only when used: "name" ->
# "module:attribute" of a click command. A module not written yet is simply not listed.
LAZY_COMMANDS = {
    "bench": "bitserve.loadtest.command:bench",
    "batch": "bitserve.offline.command:batch",
    "quantize": "bitserve.quantize.command:quantize",
    "eval": "bitserve.quantize.command:evaluate",
    "plan": "bitserve.plan.command:plan",
    "rollout": "bitserve.rollout.command:rollout",
    "optimize": "bitserve.vision.optimize.command:optimize_command",
}


class LazyGroup(click.Group):
    """Keeps `bitserve --help` and `bitserve serve` from importing every subsystem."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *(n for n in LAZY_COMMANDS if _lazy(n))})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return super().get_command(ctx, name) or _lazy(name)


def _lazy(name: str) -> click.Command | None:
    import importlib
    import importlib.util

    target = LAZY_COMMANDS.get(name)
    if target is None:
        return None
    module_name, attribute = target.split(":")
    if importlib.util.find_spec(module_name.rsplit(".", 1)[0]) is None:
        return None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return None
        raise
    return getattr(module, attribute, None)


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="bitserve")
def main() -> None:
    """bitserve: an inference server. serve, batch, bench, quantize, eval, plan."""
    # Before torch loads libgomp: its idle workers spin ~1000 rounds, not 300,000 (about
    # ms), after each parallel torch op. Spinning, they held the cores the kernels' pool
    # (bitserve/kernels/csrc/pool.c) and the server's own threads run on: 58M Llama
    # served with 2 threads, 1020 against 550 tok/s (bench/llm_serving.py).
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")


@main.command()
@click.argument(
    "model_file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--repository",
    "repository_path",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("models"),
    show_default=True,
    help="Model repository folder: one folder per model with config.toml and versions.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--grpc-port", default=8001, show_default=True, type=int, help="v2 gRPC port (0: none)."
)
@click.option(
    "--max-body-size",
    default="64MiB",
    show_default=True,
    help="Bigger request bodies get 413, bigger gRPC messages RESOURCE_EXHAUSTED.",
)
@click.option("--max-body-memory", default=None, help="Bodies in memory at once (default 4x max).")
@click.option("--header-timeout", default=10.0, show_default=True, help="Seconds to send headers.")
@click.option("--body-timeout", default=60.0, show_default=True, help="Seconds to send a body.")
@click.option(
    "--write-timeout", default=30.0, show_default=True, help="Seconds a client may stall."
)
@click.option("--threads", default=0, type=int, help="torch intra-op threads (0: default).")
@click.option(
    "--model-control",
    type=click.Choice(["none", "explicit", "poll"]),
    default="none",
    show_default=True,
    help="none: load all at start, no load/unload API. explicit: load --load-model at "
    "start and allow the API. poll: also follow the repository folder.",
)
@click.option(
    "--load-model", multiple=True, help="explicit mode: a model to load at start (* = all)."
)
@click.option("--repository-poll-secs", default=15.0, show_default=True, type=float)
@click.option(
    "--admin-token",
    envvar="BITSERVE_ADMIN_TOKEN",
    default=None,
    help="Bearer token for /v2/repository/*; without one those endpoints are off.",
)
@click.option(
    "--drain-timeout",
    default=30.0,
    show_default=True,
    type=float,
    help="On SIGTERM: seconds to let in-flight requests finish before exiting.",
)
@click.option(
    "--access-log", default=None, help="JSON line per infer request to FILE ('-': stdout)."
)
@click.option(
    "--lazy-load",
    is_flag=True,
    help="Load each model on its first request (scale-to-zero); ready says which wait.",
)
@click.option(
    "--ray",
    "ray_address",
    envvar="BITSERVE_RAY_ADDRESS",
    default=None,
    help='Ray cluster ADDRESS for models with isolation = "ray" (replicas): HOST:PORT, '
    "'auto' (this node's cluster) or 'local' (start a Ray here). Ray is imported only then.",
)
@click.option(
    "--otlp-traces-endpoint",
    envvar="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    default=None,
    help="OpenTelemetry collector for traces (OTLP/gRPC, e.g. http://127.0.0.1:4317); "
    "tracing is off without one.",
)
@click.option("--log-level", default="info", show_default=True)
def serve(
    model_file: Path | None,
    repository_path: Path,
    host: str,
    port: int,
    grpc_port: int,
    max_body_size: str,
    max_body_memory: str | None,
    header_timeout: float,
    body_timeout: float,
    write_timeout: float,
    threads: int,
    model_control: str,
    load_model: tuple[str, ...],
    repository_poll_secs: float,
    admin_token: str | None,
    drain_timeout: float,
    access_log: str | None,
    lazy_load: bool,
    ray_address: str | None,
    otlp_traces_endpoint: str | None,
    log_level: str,
) -> None:
    """Serve every model in a repository on HTTP (v2 / Open Inference Protocol), or the one
    llama.cpp MODEL_FILE (.gguf) given, as an llm model named after the file."""
    from bitserve.repository.repository import Repository
    from bitserve.server.app import create_app
    from bitserve.server.connections import ClientLimits
    from bitserve.server.state import ServerOptions

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    log_file = None
    if access_log == "-":
        log_file = sys.stdout
    elif access_log:
        log_file = open(access_log, "a", buffering=1)  # noqa: SIM115 - lives as long as serve
    options = ServerOptions(
        max_body=_size(max_body_size),
        body_memory=_size(max_body_memory) if max_body_memory else None,
        clients=ClientLimits(header_timeout, body_timeout, write_timeout),
        grpc_address=f"{host}:{grpc_port}" if grpc_port else None,
        admin_token=admin_token or None,
        model_control=model_control,
        startup_models=list(load_model) if model_control == "explicit" else None,
        poll_seconds=repository_poll_secs,
        access_log=log_file,
        lazy_load=lazy_load,
    )
    if ray_address:
        from bitserve import raycluster

        raycluster.configure(ray_address)
    if model_file is not None:
        repository_path = single_model_repository(model_file)
    repository = Repository(repository_path, drain_timeout=drain_timeout)
    repository.model_names()  # a missing folder fails here, before the port opens
    app = create_app(repository, options)
    from bitserve import tracing

    tracing.configure(otlp_traces_endpoint)
    try:
        _run(app, host, port, log_level, drain_timeout)
    finally:
        tracing.shutdown()  # the spans still buffered go out


def single_model_repository(file: Path) -> Path:
    """A repository of one llm model for a bare .gguf file: `<name>/config.toml` and
    version 1 linking to the file (gguf.py serves a folder holding one .gguf), in a
    temporary folder; the model's name is the file's stem."""
    import re
    import tempfile

    if file.suffix != ".gguf":
        raise click.UsageError(f"{file}: a model file to serve must be a .gguf")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", file.stem)
    version = Path(tempfile.mkdtemp(prefix="bitserve-")) / name / "1"
    version.mkdir(parents=True)
    (version.parent / "config.toml").write_text(f'# bitserve serve {file}\nbackend = "llm"\n')
    (version / file.name).symlink_to(file.resolve())
    return version.parent.parent


def _run(app, host: str, port: int, log_level: str, drain_timeout: float) -> None:
    """uvicorn, with SIGTERM turned into a graceful drain."""
    import uvicorn

    from bitserve.server import connections

    class DrainingServer(uvicorn.Server):
        """First SIGTERM/SIGINT: unready, 503 to new requests, wait for in-flight ones
        (at most --drain-timeout), then exit 0. A second signal exits at once."""

        draining_task: asyncio.Task | None = None

        def handle_exit(self, sig: int, frame) -> None:
            if self.draining_task is not None:
                return super().handle_exit(sig, frame)
            loop = asyncio.get_event_loop()
            self.draining_task = loop.create_task(self._drain())

        async def _drain(self) -> None:
            await app.server.drain(drain_timeout)
            self.should_exit = True

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        # timeouts uvicorn lacks, and refusals before an ASGI task exists
        http=connections.protocol(app.server.options.clients, app.admission),
        log_level="warning" if log_level == "info" else log_level,
        access_log=False,
        backlog=4096,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
    )
    DrainingServer(config).run()
    # A `--ray local` cluster ends with this process (Ray's own processes follow their
    # driver); ray.shutdown() after a SIGTERM aborts, so it is not called.
    os._exit(0)  # abandoned (wedged) instance threads must not hold the exit


if __name__ == "__main__":
    main()
