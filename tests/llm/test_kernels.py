"""The C decode kernels against torch, the fused decode layer against transformers, and
the clean fallback to torch when no compiler is there."""

from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from bitserve import kernels
from bitserve.llm import LLM, SamplingParams
from tests.llm.conftest import COMMON, build_model, make_engine
from tests.llm.test_engine import GREEDY, MIXED, assert_parity, generate

needs_kernels = pytest.mark.skipif(kernels.get() is None, reason="no C compiler here")


@pytest.fixture
def restore_kernels():
    yield
    kernels.reset()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 18, 64])  # from 4 rows: the 4x4 tile + leftovers
@pytest.mark.parametrize("k", [64, 72])  # 72: not a multiple of 16, the plain loop
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(rows, k, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k + 16, generator=g)[:, :k]  # a row stride that is not k
    w = torch.randn(37, k, generator=g)
    b = torch.randn(37, generator=g) if bias else None
    got = kernels.get().linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_silu_mul_and_rope_match_torch():
    """Prefill's elementwise kernels against the torch arithmetic they replace."""
    from bitserve.llm.models.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(7, 2 * 40, generator=g) * 4
    gate, up = gate_up.split(40, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(kernels.get().silu_mul(gate_up), want, rtol=1e-5, atol=1e-6)
    rotary = RotaryEmbedding({"rope_theta": 10000.0}, head_dim=16, max_len=64)
    rotary.kernels = kernels.get()  # what loading a model does (kernels.attach)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g)
    positions = torch.tensor([0, 3, 9, 31, 63])
    q, k, _ = qkv.split([64, 32, 32], dim=-1)
    q, k = q.view(5, 4, 16), k.view(5, 2, 16)
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    want_q = q * cos + torch.cat((-q[..., 8:], q[..., :8]), dim=-1) * sin
    want_k = k * cos + torch.cat((-k[..., 8:], k[..., :8]), dim=-1) * sin
    with torch.no_grad():  # the C path, in place on the qkv views
        got_q, got_k = rotary(positions, q, k)
    assert got_q.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-6)


@needs_kernels
def test_linear_in_row_blocks_matches_torch():
    """Many rows of a wide input: the kernel works in L2-sized row blocks (128 rows of
    1024 here) with a partial block and leftover rows at the end."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(301, 1024, generator=g), torch.randn(21, 1024, generator=g)
    b = torch.randn(21, generator=g)
    torch.testing.assert_close(
        kernels.get().linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4
    )


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 2, 16), (8, 8, 64), (4, 1, 64), (8, 2, 32)]
)
def test_paged_decode_matches_sdpa(heads, kv_heads, dim):
    g = torch.Generator().manual_seed(1)
    bs, nblk = 16, 40
    k_pool = torch.randn(kv_heads, nblk, bs, dim, generator=g)
    v_pool = torch.randn(kv_heads, nblk, bs, dim, generator=g)
    lens = [1, 17, 33, 160]
    perm = torch.randperm(nblk, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(perm[used : used + need])
        used += need
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(6, heads, dim, generator=g)  # rows 1, 2, 4, 5 are the decodes
    rows = torch.tensor([1, 2, 4, 5], dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    kernels.get().paged_decode(
        q, out, rows, k_pool, v_pool, padded, torch.tensor(lens, dtype=torch.int32), dim**-0.5
    )
    for i, (row, n) in enumerate(zip(rows.tolist(), lens, strict=True)):
        blocks = torch.tensor(tables[i])
        keys = k_pool[:, blocks].reshape(kv_heads, -1, dim)[:, :n]
        values = v_pool[:, blocks].reshape(kv_heads, -1, dim)[:, :n]
        want = F.scaled_dot_product_attention(
            q[row][None, :, None], keys[None], values[None], enable_gqa=True
        )[0, :, 0]
        torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-5)
    assert (out[[0, 3]] == 7.0).all()  # rows that are not decodes are left alone


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 4, 64), (8, 2, 32), (6, 2, 48)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (40, 0.0), (0, 30.0)])
def test_paged_decode_shares_kv_heads_with_the_same_bits(
    threads, heads, kv_heads, dim, window, softcap
):
    """The query heads of a KV head read its keys and values once, together: each head's
    output has the bits of the same head with its own copy of the KV head (kv_heads =
    heads), at batch 1 (a group split over tasks) and at 9 sequences."""
    lib = kernels.get()
    g = torch.Generator().manual_seed(3)
    bs, nblk, lens = 16, 80, [1, 16, 17, 100, 164, 3, 64, 250, 33]
    k_pool = torch.randn(kv_heads, nblk, bs, dim, generator=g)
    v_pool = torch.randn(kv_heads, nblk, bs, dim, generator=g)
    perm = torch.randperm(nblk, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // bs)])
        used += len(tables[-1])
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=g)
    rows, n = torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    group = heads // kv_heads
    lib.lib.bs_set_threads(threads)
    try:
        for batch in (1, len(lens)):
            shared, alone = torch.zeros_like(q), torch.zeros_like(q)
            args = (rows[:batch], padded[:batch], n[:batch], dim**-0.5, window, softcap)
            lib.paged_decode(q, shared, args[0], k_pool, v_pool, *args[1:])
            expanded = [p.repeat_interleave(group, 0).contiguous() for p in (k_pool, v_pool)]
            lib.paged_decode(q, alone, args[0], *expanded, *args[1:])
            assert torch.equal(shared, alone)
    finally:
        lib.lib.bs_set_threads(1)


@pytest.fixture(scope="module")
def llama64_dir(tmp_path_factory):
    """head_dim 64 (the vectorised attention path) and hidden 128 (the GEMV fast path)."""
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        **COMMON,
    )
    return build_model(tmp_path_factory.mktemp("llama64"), config)


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """The row count of every fused decoder-layer call made during the test."""
    calls: list[int] = []
    real = kernels.Kernels.decode_layer

    def counting(self, *args):
        calls.append(args[1].shape[0])
        return real(self, *args)

    monkeypatch.setattr(kernels.Kernels, "decode_layer", counting)
    return calls


@needs_kernels
@pytest.mark.parametrize("model", ["llama64", "llama", "qwen2"])
def test_fused_decode_is_token_exact(model, llama64_dir, model_dirs, fused_calls):
    calls = fused_calls
    folder = llama64_dir if model == "llama64" else model_dirs[model]
    engine = make_engine(folder, num_kv_blocks=64, max_num_seqs=4)
    assert_parity(folder, MIXED, generate(engine, MIXED))
    # decode steps and the prompts' rows alike went through the fused layer
    assert 4 in calls and max(calls) > 4


@needs_kernels
def test_fused_decode_of_a_big_batch_matches_torch(model_dirs, fused_calls, restore_kernels):
    """A small model's decode batch beyond SMALL_M rows also runs fused (its weights are
    small enough for the tiled kernel); tokens equal the torch path's."""
    from tests.llm.test_engine import random_prompts

    folder, prompts = model_dirs["llama"], random_prompts([5 + i % 7 for i in range(72)], seed=3)
    calls = fused_calls
    fused = generate(make_engine(folder, num_kv_blocks=128, max_num_seqs=72), prompts)
    assert 72 in calls  # every sequence decoding in one fused step
    kernels.reset(enabled=False)
    assert fused == generate(make_engine(folder, num_kv_blocks=128, max_num_seqs=72), prompts)


@pytest.fixture
def two_torch_threads():
    """torch at two threads for the test (the suite pins one), one again after."""
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


@pytest.mark.skipif(kernels.omp_set_num_threads() is None, reason="torch without OpenMP")
def test_torch_threads_here_is_this_threads_alone(two_torch_threads):
    """Inside the block this thread's torch ops take one thread; a thread that starts
    meanwhile keeps torch's count (torch.set_num_threads would change it too)."""
    seen = {}
    with kernels.torch_threads_here(1):
        seen["inside"] = torch.get_num_threads()
        with ThreadPoolExecutor(1) as pool:
            seen["other thread"] = pool.submit(torch.get_num_threads).result()
    seen["after"] = torch.get_num_threads()
    assert seen == {"inside": 1, "other thread": 2, "after": 2}


@needs_kernels
@pytest.mark.skipif(kernels.omp_set_num_threads() is None, reason="torch without OpenMP")
def test_a_step_the_c_layer_runs_keeps_torch_to_one_thread(
    llama64_dir, fused_calls, two_torch_threads, restore_kernels
):
    """torch's OpenMP workers would spin on the cores the kernels' pool needs: a step the
    C layer runs has torch at one thread on the engine's thread; without the kernels the
    step is torch's and keeps its two threads; after a step, two again."""
    counts = {}
    for enabled in (True, False):
        kernels.reset(enabled=enabled)
        engine = make_engine(llama64_dir, num_kv_blocks=64, max_num_seqs=4)
        seen = counts[enabled] = []
        engine.fault_hook = lambda seqs, seen=seen: seen.append(torch.get_num_threads())
        generate(engine, MIXED)
        assert torch.get_num_threads() == 2
    assert fused_calls and set(counts[True]) == {1}
    assert counts[False] and set(counts[False]) == {2}


def test_fallback_without_compiler(llama_dir, tmp_path, monkeypatch, restore_kernels):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("BITSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    kernels.reset()
    assert kernels.get() is None
    engine = make_engine(llama_dir, num_kv_blocks=64)
    assert_parity(llama_dir, MIXED, generate(engine, MIXED))


def test_disabled_kernels_give_the_same_tokens(model_dirs, restore_kernels):
    kernels.reset(enabled=False)
    assert kernels.get() is None
    folder = model_dirs["llama"]
    engine = make_engine(folder, num_kv_blocks=64)
    assert_parity(folder, MIXED, generate(engine, MIXED, GREEDY))


def test_zeros_huge_pages():
    small = kernels.zeros_huge_pages((3, 4))
    assert small.shape == (3, 4) and not small.any()
    big = kernels.zeros_huge_pages((2, 1024, 1024))
    assert big.shape == (2, 1024, 1024) and big.is_contiguous() and not big.any()
    big += 1  # the whole view is writable
    assert big.sum().item() == 2 * 1024 * 1024


def test_onto_huge_pages_together_moves_the_data_in_place():
    """Each tensor keeps its values and stays the same object (every reference, a tied
    head's too, reads the move), now one after another in a buffer that starts on a
    2 MiB boundary, each on a 64-byte one."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (2048, 1100), dtype=torch.int8, generator=g)  # > 2 MiB
    b = torch.randn(3, 5, generator=g)
    expect, tied = [a.clone(), b.clone()], a
    kernels.onto_huge_pages_together([a, b])
    assert torch.equal(a, expect[0]) and torch.equal(b, expect[1]) and tied is a
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert b.data_ptr() - a.data_ptr() == -(-a.numel() // 64) * 64
    if platform.system() == "Linux":
        assert a.data_ptr() % (2 << 20) == 0


@needs_kernels
@pytest.mark.parametrize("struct", ["Weight", "LayerParams"])
def test_struct_layout_is_the_compilers(struct):
    """cffi lays the structs out from csrc/bitserve.h by its own rules; the compiler's
    offsetof and sizeof (`bs_layout`) agree field by field, and every field is listed."""
    ffi, lib = kernels.ffi(), kernels.get()
    fields = [name for name, _ in ffi.typeof(struct).fields]
    assert {f: lib.layout(struct, f) for f in fields} == {
        f: ffi.offsetof(struct, f) for f in fields
    }
    assert lib.layout(struct) == ffi.sizeof(struct)


@needs_kernels
def test_every_declared_function_is_in_the_library():
    lib = kernels.get().lib
    assert {"bs_linear", "bs_gemv", "bs_decode_layer", "bs_paged_decode"} <= set(dir(lib))
    for name in dir(lib):
        assert callable(getattr(lib, name))  # cffi resolves the symbol here


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 24, 25, 100])  # tiles of 12, K blocks above 24
@pytest.mark.parametrize(("n", "k"), [(48, 64), (32, 300), (16, 700)])  # 1-3 panels, any K
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k + 3, generator=g)[:, :k]  # a row stride that is not k
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    lib = kernels.get()
    got = lib.linear_packed(x, lib.pack(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    # a row's result does not depend on the rows batched with it
    torch.testing.assert_close(got[-1:], lib.linear_packed(x[-1:], lib.pack(w), b), rtol=0, atol=0)


@needs_kernels
def test_loading_packs_every_own_weight_but_a_tied_head(model_dirs):
    from bitserve.llm.models.layers import Linear

    model = make_engine(model_dirs["llama"], num_kv_blocks=16).runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    tied = model.lm_head.weight is model.embed_tokens.weight
    assert all(m.packed for m in linears if m is not model.lm_head)
    assert model.lm_head.packed == (not tied and model.lm_head.weight.shape[0] % 16 == 0)


@needs_kernels
@pytest.mark.parametrize("threads", [2, 3])
def test_the_pool_gives_the_same_bits(threads):
    """The packed GEMM splits the weights (and, above 24 rows, the row chunks) and the
    decode attention the (sequence, head) pairs over the pool's threads: whichever thread
    claims a task, no output's arithmetic changes. Also while a second Python thread
    calls the kernels at the same time (it runs its tasks alone)."""
    lib = kernels.get()
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2080, 300, generator=g)  # 130 panels: three groups of up to 64
    packed = lib.pack(w)
    xs = [torch.randn(m, 300, generator=g) for m in (1, 16, 100, 250)]
    q = torch.randn(8, 8, 64, generator=g)
    pools = [torch.randn(2, 20, 16, 64, generator=g) for _ in range(2)]
    tables = torch.arange(20, dtype=torch.int32).view(4, 5)
    rows, lens = (
        torch.arange(4, dtype=torch.int32),
        torch.tensor([5, 33, 80, 17], dtype=torch.int32),
    )

    def run():
        out = torch.zeros_like(q)
        lib.paged_decode(q, out, rows, *pools, tables, lens, 0.125)
        return [lib.linear_packed(x, packed, None) for x in xs] + [out]

    alone = run()
    try:
        lib.lib.bs_set_threads(threads)
        pooled = [run() for _ in range(3)]
        with ThreadPoolExecutor(2) as side:
            both = list(side.map(lambda _: run(), range(4)))
    finally:
        lib.lib.bs_set_threads(1)
    for result in pooled + both:
        assert all(torch.equal(a, b) for a, b in zip(alone, result, strict=True))


@needs_kernels
def test_steps_on_the_pool_give_the_same_bits(llama64_dir):
    """A prompt step (224 rows) and decode steps with their GEMMs, attention and
    elementwise rows split over three threads give the tokens and log-probabilities of
    one thread, bit for bit."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)

    def run(threads):
        llm = LLM.__new__(LLM)
        llm.engine = make_engine(llama64_dir, num_kv_blocks=64)
        kernels.get().lib.bs_set_threads(threads)  # after load: attach sets torch's count
        try:
            outputs = llm.generate(MIXED, params)
        finally:
            kernels.get().lib.bs_set_threads(1)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    assert run(3) == run(1)
