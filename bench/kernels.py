"""The C kernels (`bs_linear`, `bs_linear_packed`) against torch's F.linear (MKL) at LLM shapes.

    .venv/bin/python -m bench.kernels [--threads 1] [--rows 1,4,16,64] [--shapes 58m,1b,mlp]

For each weight shape and row count: time per call (best of --repeat) of the row kernel
(`bs_linear`), the packed-panel GEMM every fp32 linear runs once loaded
(`bs_linear_packed`) and torch; the packed kernel's weight read rate (GB/s, what batch-1
decode is bound by) and GFLOP/s, and its speed-up over torch. A plain read of the
same bytes (a sum) is the bandwidth ceiling measured in the same run. This is what
`layers.Linear.fuse_rows` (SMALL_M, SMALL_WEIGHT) is chosen from.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bitserve import kernels

# Weights [N, K]: gate_up and down of the bench's Llamas (58M, ~250M, ~1B), and the
# default repository's mlp, whose linears a torch.export program runs packed
SHAPES = {
    "58m": [(3072, 512), (512, 1536)],
    "250m": [(5632, 1024), (1024, 2816)],
    "1b": [(11264, 2048), (2048, 5632)],
    "mlp": [(1024, 512), (1024, 1024), (512, 1024)],
}


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--shapes", default="58m,1b")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = kernels.get()
    if lib is None:
        raise SystemExit("no C kernels here (no compiler, or BITSERVE_NO_KERNELS=1)")
    lib.lib.bs_set_threads(args.threads)  # the kernels' pool, as kernels.attach sets it
    head = ("shape", "N x K", "rows", "row ms", "packed ms", "torch ms", "GB/s", "read GB/s")
    widths = (6, 12, 5, 8, 9, 9, 6, 9)
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)), "GFLOP/s vs torch")
    for name in args.shapes.split(","):
        for n, k in SHAPES[name]:
            w = torch.randn(n, k)
            packed = lib.pack(w)
            gb = w.numel() * 4 / 1e9
            read_ms = best_ms(lambda w=w: w.sum(), args.repeat)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k)
                c_ms = best_ms(lambda x=x, w=w: lib.linear(x, w, None), args.repeat)
                p_ms = best_ms(lambda x=x, p=packed: lib.linear_packed(x, p, None), args.repeat)
                t_ms = best_ms(lambda x=x, w=w: F.linear(x, w), args.repeat)
                print(
                    f"{name:>6} {f'{n}x{k}':>12} {rows:>5} {c_ms:>8.3f} {p_ms:>9.3f} {t_ms:>9.3f} "
                    f"{gb / p_ms * 1e3:>6.1f} {gb / read_ms * 1e3:>9.1f} "
                    f"{2 * rows * n * k / p_ms / 1e6:>8.1f} {t_ms / p_ms:>7.2f}x"
                )


if __name__ == "__main__":
    main()
