"""`bitserve bench`: load generator, metrics, reports and plots (see command.py)."""
