"""`bitserve bench`: load generator, metrics, reports and plots (see command.py).

The repository's own benchmark scripts (`python -m bench.NAME`, top-level `bench/`) drive
servers with this load generator; this package is the tool users run against theirs.
"""
