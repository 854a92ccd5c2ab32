"""The `bitserve` command."""

from __future__ import annotations

import logging
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


@click.group()
@click.version_option(__version__, prog_name="bitserve")
def main() -> None:
    """bitserve: serve models over the KServe v2 protocol with dynamic batching."""


@main.command()
@click.option(
    "--repository",
    "repository_path",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("models"),
    show_default=True,
    help="Model repository folder: one folder per model with config.toml and versions.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--max-body-size",
    default="64MiB",
    show_default=True,
    help="Largest request body; bigger ones get 413.",
)
@click.option(
    "--threads",
    default=0,
    type=int,
    help="torch intra-op threads for the whole process (0: library default).",
)
@click.option("--log-level", default="info", show_default=True)
def serve(
    repository_path: Path, host: str, port: int, max_body_size: str, threads: int, log_level: str
) -> None:
    """Serve every model in a repository on HTTP (v2 / Open Inference Protocol)."""
    import uvicorn

    from bitserve.repository.repository import Repository
    from bitserve.server.app import create_app

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    repository = Repository(repository_path)
    repository.scan()
    app = create_app(repository, max_body=_size(max_body_size))
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning" if log_level == "info" else log_level,
        access_log=False,
        backlog=4096,
        timeout_keep_alive=30,
    )


if __name__ == "__main__":
    main()
