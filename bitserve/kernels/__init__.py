"""bitserve's CPU kernels: C sources in `csrc/`, built once with the system's compiler.

`csrc/bitserve.h` declares every exported struct and function; cffi reads the same header
as its `cdef`, so there is one statement of each signature and layout (no hand-kept
ctypes mirrors), and tests/llm/test_kernels.py holds cffi's layout to the compiler's.
The `.c` files are compiled with `-march=native -ffast-math` (vectorised `expf` and
reductions) and linked without fast-math, so loading the library does not switch the
process to flush-to-zero. The packed GEMM and the decode attention split their work
over `torch.get_num_threads()` threads, set when a model is attached, through their own
small pool (csrc/pool.c: tasks claimed from a counter, so a descheduled thread never
holds up a step, as an OpenMP team's join does on a shared box). The shared
object lands in `$BITSERVE_KERNEL_CACHE` (default `~/.cache/bitserve/kernels`) under a
hash of the sources, flags, compiler and CPU.

Whether a model uses them is decided once, when it is loaded (`attach`): modules that
can run a kernel declare a `kernels` attribute (None: the torch path), and the loader
sets it on every one of them. Without a compiler, or with `BITSERVE_NO_KERNELS=1`,
`get()` is None and every module keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import torch
from cffi import FFI

CSRC = Path(__file__).parent / "csrc"
HEADER = CSRC / "bitserve.h"
COMPILE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-fPIC"]
FAST_MATH = ["-ffast-math"]  # compile step only


@cache
def ffi() -> FFI:
    """The header's declarations, as cffi parses them (preprocessor lines dropped)."""
    declarations = FFI()
    text = HEADER.read_text()
    declarations.cdef(re.sub(r"^\s*#.*$", "", text, flags=re.MULTILINE))
    return declarations


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


def cpu_signature() -> str:
    """The CPU model and flags: a cached -march=native build must not move between CPUs."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def cache_dir() -> Path:
    root = os.environ.get("BITSERVE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "bitserve" / "kernels"


def compiler() -> str | None:
    """The C compiler to build with; None without one or with BITSERVE_NO_KERNELS=1."""
    if os.environ.get("BITSERVE_NO_KERNELS") == "1":
        return None
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(cc: str) -> Path:
    """Compile csrc/ into a cached shared object (atomic rename: safe across processes),
    keyed by every source and header, the flags, the compiler and the CPU."""
    files = sorted(CSRC.glob("*.[ch]"))
    parts = [f.name + "\0" + f.read_text() for f in files]
    key = "\0".join([*parts, *COMPILE_FLAGS, *FAST_MATH, cc, cpu_signature()])
    target = cache_dir() / f"bitserve_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        run = dict(check=True, capture_output=True, timeout=300, cwd=tmp)
        objects = []
        for source in sources():
            obj = Path(tmp) / f"{source.stem}.o"
            command = [cc, *COMPILE_FLAGS, *FAST_MATH, f"-I{CSRC}", "-c", str(source)]
            subprocess.run([*command, "-o", str(obj)], **run)
            objects.append(str(obj))
        lib = Path(tmp) / "bitserve.so"
        link = [cc, "-shared", "-pthread", *objects, "-o", str(lib)]
        try:  # the vectorised expf lives in libmvec (glibc); plain libm otherwise
            subprocess.run([*link, "-lmvec", "-lm"], **run)
        except subprocess.CalledProcessError:
            subprocess.run([*link, "-lm"], **run)
        os.replace(lib, target)
    return target


def ptr(t: torch.Tensor | None, ctype: str = "float *") -> Any:
    """A tensor's data as a C pointer (NULL for None); the tensor must outlive it."""
    return ffi().NULL if t is None else ffi().cast(ctype, t.data_ptr())


def matmul(fn: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """y [M, N] = fn(x [M, K], weight [N, K] as fn reads it, bias) for bs_linear and
    bs_linear_packed, which take the same arguments."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    fn(ptr(x), x.stride(0), m, k, ptr(weight), n, ptr(bias), ptr(y))
    return y


class Kernels:
    """The loaded library: thin wrappers that take tensors."""

    _decode_args: tuple | None = None  # decode_layer's last tensors and their pointers

    def __init__(self, path: Path):
        self.lib = ffi().dlopen(str(path))
        # bf16 weights: vdpbf16ps where built, unless BITSERVE_BF16_DOT=0 asks for widen +
        # FMA (set every time: a second dlopen of the same file shares its globals)
        self.lib.bs_bf16_mode(0 if os.environ.get("BITSERVE_BF16_DOT") == "0" else 1)

    def bf16_mode(self, mode: int = -1) -> int:
        """The bf16 kernels' inner loop (csrc/bf16.c): 1 vdpbf16ps, 0 widen + FMA; set it
        with `mode` >= 0 (1 falls back to 0 where the build has no avx512_bf16)."""
        return self.lib.bs_bf16_mode(mode)

    def pack_bf16(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] contiguous bf16 -> `bs_bf16_pack`'s panels, [N16, 2 K2] bf16 (N16:
        N rounded up to 16, K2 = ceil(K / 2)): the shape of weight when N % 16 == 0 and K
        is even."""
        n, k = weight.shape
        if weight.dtype is not torch.bfloat16 or not weight.is_contiguous():
            raise ValueError("pack_bf16 takes a contiguous bf16 [N, K]")
        packed = empty_huge_pages((-(-n // 16) * 16, 2 * ((k + 1) // 2)), torch.bfloat16)
        self.lib.bs_bf16_pack(ptr(weight, "uint16_t *"), n, k, ptr(packed, "uint16_t *"))
        return packed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """x [M, K] fp32 with unit inner stride; weight [N, K] contiguous fp32."""
        return matmul(self.lib.bs_linear, x, weight, bias)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] contiguous fp32, N a multiple of 16 -> the same shape holding
        `bs_pack`'s panels (16 output rows, column by column)."""
        n, k = weight.shape
        if n % 16 or weight.dtype is not torch.float32 or not weight.is_contiguous():
            raise ValueError(f"pack takes a contiguous fp32 [N, K] with N % 16 == 0, not {n}")
        packed = empty_huge_pages((n, k))
        self.lib.bs_pack(ptr(weight), n, k, ptr(packed))
        return packed

    def linear_packed(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
        """x [M, K] fp32 with unit inner stride; packed: `pack()`'s [N, K] -> [M, N]."""
        return matmul(self.lib.bs_linear_packed, x, packed, bias)

    def gemv(self, w: Any, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 with unit inner stride, through a `Weight` -> [M, N] fp32."""
        y = torch.empty(x.shape[0], w.N, dtype=torch.float32)
        self.lib.bs_gemv(w, ptr(x), x.stride(0), x.shape[0], ptr(y))
        return y

    def i8_gemm(self, x: torch.Tensor, w: torch.Tensor, wsum: torch.Tensor) -> torch.Tensor:
        """x [M, K] int8 (unit inner stride) @ w [N, K] int8 (contiguous).T -> int32 [M, N],
        exactly; wsum: w.sum(1) as int32 (csrc/qgemm.c)."""
        m, k = x.shape
        y = torch.empty(m, w.shape[0], dtype=torch.int32)
        i8 = "int8_t *"
        self.lib.bs_i8_gemm(ptr(x, i8), x.stride(0), m, k, ptr(w, i8), ptr(wsum, "int32_t *"),
                            w.shape[0], ptr(y, "int32_t *"))  # fmt: skip
        return y

    def lora_add(self, x, slots, a, bt, y) -> None:
        """LoRA deltas in place on y [M, N]: x [M, K] (unit inner stride), slots int32 [M]
        (-1: no adapter), a [S, W, K] and bt [S, W, N] contiguous (csrc/lora.c)."""
        m, k = x.shape
        s, w, n = bt.shape
        where = ptr(slots, "int *")
        self.lib.bs_lora_add(
            ptr(x), x.stride(0), m, k, where, ptr(a), ptr(bt), s, w, n, ptr(y), y.stride(0)
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2I] contiguous fp32 (gate | up) -> silu(gate) * up, [M, I]."""
        m, two_i = gate_up.shape
        out = torch.empty(m, two_i // 2, dtype=torch.float32)
        self.lib.bs_silu_mul(ptr(gate_up), m, two_i // 2, ptr(out))
        return out

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos, sin) -> None:
        """In place on x [T, H, D] fp32 (heads contiguous in a row, any row stride);
        positions int64 [T] contiguous; cos, sin [max_len, D] contiguous fp32."""
        t, h, d = x.shape
        where = ptr(positions, "int64_t *")
        self.lib.bs_rope_rows(ptr(x), t, x.stride(0), h, d, where, ptr(cos), ptr(sin))

    def paged_decode(
        self, q, out, rows, k_pool, v_pool, tables, lens, scale: float, window=0, softcap=0.0
    ) -> None:
        """q, out: [T, Hq, D] contiguous fp32; rows, lens: int32 [B]; tables: int32 [B, W];
        window: attend to the last `window` keys only (0: all); softcap: Gemma 2's."""
        hkv, nblk, bs, d = k_pool.shape
        self.lib.bs_paged_decode(
            *(ptr(q), ptr(out), ptr(rows, "int *"), rows.shape[0], q.shape[1], hkv, d),
            *(ptr(k_pool), ptr(v_pool), nblk, bs, ptr(tables, "int *"), tables.shape[1]),
            *(ptr(lens, "int *"), scale, window, softcap),
        )

    def decode_layer(self, params: Any, x, positions, slots, decode, scratch) -> None:
        """One decoder layer (`LayerParams`), in place on x [M, H], every row a decode.

        positions, slots: int64 [M]; decode: the step's `DecodeBatch`; scratch: fp32 with
        at least M * (2H + 2 Hq D + 2 Hkv D + 3 I) elements. Every layer of a step
        passes the same tensors: their pointers are cast for the first and kept while
        the same objects come back (the cache holds them, so none can be freed and its
        address reused meanwhile), not 8 casts a layer (~8 us a step on tinylm).
        """
        last = self._decode_args
        if not (
            last is not None
            and last[0] is x
            and last[1] is positions
            and last[2] is slots
            and last[3] is decode
            and last[4] is scratch
        ):
            tensors = (x, positions, slots, decode, scratch)
            last = self._decode_args = (*tensors, decode_args(*tensors))
        self.lib.bs_decode_layer(params, *last[5])

    def layout(self, struct: str, field: str = "") -> int:
        """The compiler's offsetof(struct, field) (sizeof for ""), -1 if not listed."""
        return self.lib.bs_layout(struct.encode(), field.encode())


def decode_args(x, positions, slots, decode, scratch) -> tuple:
    """`bs_decode_layer`'s arguments after the layer's params, cast once: every layer of
    a step takes the same ones (the tensors must outlive the tuple)."""
    tables = decode.block_tables
    return (
        *(ptr(x), x.shape[0], ptr(positions, "int64_t *"), ptr(slots, "int64_t *")),
        *(ptr(decode.rows, "int *"), ptr(tables, "int *"), tables.shape[1]),
        *(ptr(decode.context_lens, "int *"), ptr(scratch)),
    )


def fp32_weight(
    weight: torch.Tensor, bias: torch.Tensor | None, packed: bool = False, lora=None
) -> Any:
    """A `Weight` view of an fp32 linear layer: weight [N, K] contiguous (`packed`: as
    `Kernels.pack` left it); `lora`: its LoRA slots (a, bt, row slots) as
    `Kernels.lora_add` takes them, added after the product."""
    n, k = weight.shape
    fields = {"kind": 3 if packed else 0, "data": ptr(weight), "bias": ptr(bias), "N": n, "K": k}
    return ffi().new("Weight *", fields | lora_fields(lora))


def bf16_weight(panels: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, lora=None):
    """A `Weight` view (kind 5) of bf16 weights [n, k] packed by `Kernels.pack_bf16`."""
    fields = {"kind": 5, "data": ptr(panels, "void *"), "bias": ptr(bias), "N": n, "K": k}
    return ffi().new("Weight *", fields | lora_fields(lora))


def lora_fields(lora) -> dict[str, Any]:
    """A `Weight`'s LoRA fields for (a, bt, row slots) as `Kernels.lora_add` takes them."""
    if lora is None:
        return {}
    a, bt, slots = lora
    fields = {"lora_a": ptr(a), "lora_bt": ptr(bt), "lora_slots": ptr(slots, "int *")}
    return fields | {"lora_S": a.shape[0], "lora_W": a.shape[1]}


def layer_params(**fields: Any) -> Any:
    """A `LayerParams` (fields as in csrc/bitserve.h; tensors become pointers)."""
    pointers = {k: ptr(v) for k, v in fields.items() if v is None or isinstance(v, torch.Tensor)}
    weights = {k: v[0] for k, v in fields.items() if isinstance(v, ffi().CData)}
    scalars = {k: v for k, v in fields.items() if k not in pointers and k not in weights}
    return ffi().new("LayerParams *", {**pointers, **weights, **scalars})


def attach(model: torch.nn.Module, kernels: Kernels | None) -> None:
    """Decide C or torch for a loaded model, once: set `kernels` on every module that
    declares it (None keeps the torch path), and let those that can `pack()` their
    weights for the kernels, unless a weight is shared (a tied LM head: the embedding
    reads the same tensor row by row)."""
    if kernels is not None:
        kernels.lib.bs_set_threads(torch.get_num_threads())
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    # children first: a model deciding from its layers (fuse_rows) sees them packed
    for module in reversed(list(model.modules())):
        if hasattr(type(module), "kernels"):
            module.kernels = kernels
            own = all(uses[id(p)] == 1 for p in module.parameters(recurse=False))
            if kernels is not None and own and hasattr(module, "pack"):
                module.pack()


@cache
def omp_set_num_threads() -> Any:
    """`omp_set_num_threads` of the OpenMP runtime torch's ops run on (looked up through
    libtorch_cpu, so the one it linked: torch's bundled libgomp, not another library's),
    or None where there is none (another threading backend, no such library)."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if "OpenMP" not in torch.__config__.parallel_info() or not lib.exists():
        return None
    try:
        fn = ctypes.CDLL(str(lib)).omp_set_num_threads
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], None
    return fn


@contextmanager
def torch_threads_here(n: int) -> Iterator[None]:
    """Torch's ops on the calling thread use at most `n` OpenMP threads inside the block;
    every other thread keeps its count (OpenMP's is per thread; `torch.set_num_threads`
    would also change the default every thread not yet started takes).

    For a step the C kernels run on their pool: its torch ops are small (the sampler's
    max over the vocabulary, an embedding gather), but one that crosses torch's grain
    size wakes an OpenMP team, whose workers then spin (libgomp: ~300,000 pauses, some
    milliseconds) on the cores the pool's workers need: a 246M int8 decode step at two
    threads took 27 ms against 21 with them kept asleep.
    """
    set_threads = omp_set_num_threads()
    before = torch.get_num_threads()  # also torch's first setting of this thread's count
    if set_threads is None or before <= n:
        yield
        return
    set_threads(n)
    try:
        yield
    finally:
        set_threads(before)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`torch.empty(shape)` backed by transparent huge pages where Linux allows it.

    What the kernels stream is read far faster from 2 MiB pages: the KV pool in 4 KiB
    pieces (a block of one head) in block-table order, where on 4 KiB pages every piece
    is a TLB miss and a prefetcher restart (half the decode-attention read rate), and the
    packed weights (batch-1 decode reads some shapes at ~25 GB/s on 4 KiB pages, ~39 on
    huge pages). The tensor is a view at a 2 MiB-aligned offset of a slightly larger
    buffer, advised before its pages are first touched.
    """
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if numel * itemsize < HUGE_PAGE or platform.system() != "Linux":
        return torch.empty(shape, dtype=dtype)
    buf = torch.empty(numel + HUGE_PAGE // itemsize, dtype=dtype)
    offset = (-buf.data_ptr()) % HUGE_PAGE // itemsize
    start = buf.data_ptr() + offset * itemsize
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(numel * itemsize), MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
    return buf[offset : offset + numel].view(shape)


def onto_huge_pages_together(tensors: list[torch.Tensor]) -> None:
    """Move the tensors' data, one after another, into one buffer on huge pages, in place
    (`set_`: every reference to a tensor reads the new copy; the old storage is freed once
    nothing else holds it). CPU tensors only; each starts on a 64-byte boundary."""
    tensors = [t for t in tensors if t.device.type == "cpu" and t.is_contiguous()]
    if not tensors:
        return
    nbytes = [t.numel() * t.element_size() for t in tensors]
    slots = [-(-n // 64) * 64 for n in nbytes]  # each rounded up to 64 bytes
    arena = empty_huge_pages((sum(slots),), torch.uint8)
    offset = 0
    with torch.no_grad():
        for t, n, slot in zip(tensors, nbytes, slots, strict=True):
            moved = arena[offset : offset + n].view(t.dtype).view(t.shape)
            moved.copy_(t)
            t.set_(moved.untyped_storage(), moved.storage_offset(), moved.shape, moved.stride())
            offset += slot


def zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`torch.zeros(shape)` on huge pages (`empty_huge_pages`): the KV pool."""
    return empty_huge_pages(shape, dtype).zero_()


class Library:
    """The library built on first use and kept for the process; None where it cannot be
    (no compiler, a failed build, or BITSERVE_NO_KERNELS=1)."""

    def __init__(self):
        self.loaded: Any = False  # False: not tried yet

    def get(self) -> Kernels | None:
        if self.loaded is False:
            self.loaded = None
            if cc := compiler():
                try:
                    self.loaded = Kernels(build(cc))
                except (OSError, subprocess.SubprocessError):
                    self.loaded = None
        return self.loaded

    def reset(self, enabled: bool | None = None) -> None:
        """Forget the loaded library (tests): `enabled=False` forces the torch paths."""
        self.loaded = None if enabled is False else False


_library = Library()


def get() -> Kernels | None:
    """The compiled kernels, or None (no compiler, build failed, or disabled)."""
    return _library.get()


def reset(enabled: bool | None = None) -> None:
    """Forget the loaded kernels (tests): `enabled=False` forces the torch paths."""
    _library.reset(enabled)
