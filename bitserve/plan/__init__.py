"""`bitserve plan`: size a deployment before paying for it.

memory (what a model needs), hardware (which instance shape serves it cheapest),
fit (which distributions the traffic and latencies follow) and capacity (how many
replicas keep p99 under the SLO, by simulating the dynamic batcher).
"""
