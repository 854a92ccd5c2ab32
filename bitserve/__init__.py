"""bitserve: a Python inference server."""

__version__ = "0.1.0"
