"""Peer servers and shared model code for `bench/batching.py`.

Each peer is a script the benchmark starts as its own process (`python bench/peers/X.py
--port N`), pinned to the same core as bitserve, so that every server gets the same CPU.
"""
