"""Offline batch inference: `bitserve batch` runs the server's model code over files."""
