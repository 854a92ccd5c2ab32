"""`bitserve batch`: offline inference over a file, in-process, over local worker
processes (one engine per core) or over a Ray cluster.

bitserve batch --input requests.jsonl --output answers.jsonl            # OpenAI Batch format
bitserve batch --input rows.csv --output out.jsonl --model minilm --map text=sentence
bitserve batch --input requests.jsonl --output answers.jsonl --workers 2   # 2 processes
bitserve batch --input requests.jsonl --output answers.jsonl --ray local --ray-workers 4

Run it again with the same arguments after a crash: it resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import click


@click.command()
@click.option(
    "--repository",
    "repository_path",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=Path("models"),
    show_default=True,
)
@click.option(
    "--input", "input_path", required=True, type=click.Path(dir_okay=False, path_type=Path)
)
@click.option(
    "--output", "output_path", required=True, type=click.Path(dir_okay=False, path_type=Path)
)
@click.option("--model", default=None, help="Plain rows (JSONL/CSV/Parquet) for this v2 model.")
@click.option("--map", "mapping", multiple=True, help="input=column (plain rows).")
@click.option("--id-column", default=None, help="Column that names each row (plain rows).")
@click.option(
    "--max-in-flight", default=512, show_default=True, type=int, help="Records at once, per worker."
)
@click.option(
    "--threads", default=0, type=int, help="torch intra-op threads (0: default; 1 per worker)."
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Local worker processes, each with its own copy of the models (1: this process).",
)
@click.option("--ray", "ray_address", default=None, help="Ray cluster ADDRESS, or 'local'.")
@click.option("--ray-workers", default=2, show_default=True, type=int)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--log-level", default="warning", show_default=True)
def batch(
    repository_path: Path,
    input_path: Path,
    output_path: Path,
    model: str | None,
    mapping: tuple[str, ...],
    id_column: str | None,
    max_in_flight: int,
    threads: int,
    workers: int,
    ray_address: str | None,
    ray_workers: int,
    no_progress: bool,
    log_level: str,
) -> None:
    """Run every record of INPUT through the repository's models into OUTPUT (JSONL)."""
    from bitserve.offline.job import JobOptions, run_job
    from bitserve.offline.journal import JournalError
    from bitserve.offline.parallel import WorkerError
    from bitserve.offline.rows import RowMapping, parse_mapping

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    if workers > 1 and ray_address:
        raise click.BadParameter("use --workers or --ray, not both", param_hint="--workers")
    if not input_path.is_file():
        raise click.BadParameter(f"{input_path} does not exist", param_hint="--input")
    try:
        rows = RowMapping(model, parse_mapping(mapping), id_column) if model else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--map") from None
    opts = JobOptions(
        repository_path, input_path, output_path, rows, max_in_flight, progress=not no_progress
    )
    try:
        if ray_address:
            from bitserve.offline.distributed import run_ray

            summary = run_ray(opts, ray_address, ray_workers)
        elif workers > 1:
            from bitserve.offline.parallel import run_parallel

            summary = run_parallel(opts, workers, threads or 1)
        else:
            summary = asyncio.run(run_job(opts))
    except (JournalError, WorkerError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(summary.line(), err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # engine and instance threads must not hold the exit
