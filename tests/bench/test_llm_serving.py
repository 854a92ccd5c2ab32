"""bench/llm_serving.py and bench/perplexity.py: the logic their figures rest on, without
any server. Round order, fresh prompts per round, spreads and per-round ratios, the
arms' precisions (llama-server's KV cache included), what the JSON records, and the
perplexity windows that must match llama-perplexity's."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest

from bench import llm_serving as ls
from bench import perplexity as pp
from bitserve.loadtest.workloads import Lengths, OpenAIOptions, openai_prompts


def point(tok_s: float, ttft_p99: float = 1000.0) -> dict:
    """The fields of a `bitserve bench` point the summaries read."""
    ttft = {"median_ms": ttft_p99 / 2, "p99_ms": ttft_p99}
    return {"completed": 64, "output_throughput": tok_s, "ttft": ttft, "tpot": {"median_ms": 9.0}}


def test_each_arm_leads_once_and_takes_every_place_over_a_cycle():
    arms = ["a", "b", "c", "d"]
    orders = [ls.rotation(arms, r) for r in range(len(arms))]
    assert orders[0] == arms and orders[1] == ["b", "c", "d", "a"]
    for place in range(len(arms)):
        assert sorted(order[place] for order in orders) == arms
    assert ls.rotation(arms, 5) == orders[1]


def test_rounds_get_prompts_no_other_round_sent():
    """Round r runs `bitserve bench --seed r`: 80 prompts each, none shared across rounds."""
    opts = OpenAIOptions(model="m", lengths=Lengths(100, 64, "fixed"))
    rounds = [{p for p, _, _ in openai_prompts(opts, 80, seed)} for seed in range(3)]
    assert all(len(r) == 80 for r in rounds)
    assert not (rounds[0] & rounds[1] or rounds[1] & rounds[2] or rounds[0] & rounds[2])


def test_spread_is_median_min_max_over_the_rounds_that_ran():
    rounds = [{"x": point(100.0)}, {"x": {"error": "exited with 1"}}, {"x": point(300.0)}]
    rounds.append({"x": point(120.0)})
    s = ls.summarise(rounds, ["x"])["x"]
    assert s["output_tok_s"] == {"median": 120.0, "min": 100.0, "max": 300.0, "n": 3}
    assert s["ttft_p99_ms"]["median"] == 1000.0 and s["tpot_p50_ms"]["n"] == 3
    assert s["errors"] == ["exited with 1"]
    assert ls.summarise([{"x": {"error": "e"}}], ["x"])["x"]["output_tok_s"] is None


def test_ratios_are_taken_within_each_round_then_summarised():
    """Per round 2, 0.5, 2: median 2. The ratio of the medians (200/150) would be 1.33."""
    mine, peer = [100.0, 200.0, 300.0], [50.0, 400.0, 150.0]
    rounds = [
        {"b": point(m, 500.0), "p": point(q, 1000.0)} for m, q in zip(mine, peer, strict=True)
    ]
    rounds.append({"b": point(999.0), "p": {"error": "crashed"}})  # no pair: left out
    r = ls.ratios(rounds, [("b", "p")])["b / p"]
    assert r["output_tok_s"] == {"median": 2.0, "min": 0.5, "max": 2.0, "n": 3}
    assert r["ttft_p99_ms"]["median"] == 0.5


def test_best_bitserve_arm_at_equal_or_better_perplexity():
    arms = [a for a in ls.MODES["recommended"] if a.server != "vllm"]
    speeds = {"bitserve int4": 300.0, "bitserve Q4_K_M": 200.0, "bitserve Q8_0": 150.0}
    speeds |= {"llama.cpp Q4_K_M": 100.0, "llama.cpp Q8_0": 80.0}
    rounds = [{name: point(v * k) for name, v in speeds.items()} for k in (1.0, 1.1)]
    ppl = {"bitserve int4": 26.0, "bitserve Q4_K_M": 25.3, "llama.cpp Q4_K_M": 25.29}
    ppl |= {"bitserve Q8_0": 25.0, "llama.cpp Q8_0": 24.9}
    best = ls.best_at_quality(rounds, arms, ppl)
    # int4 is fastest but worse than Q4_K_M; bitserve's Q4_K_M is within fp rounding
    assert best["llama.cpp Q4_K_M"]["bitserve"] == "bitserve Q4_K_M"
    assert best["llama.cpp Q4_K_M"]["output_tok_s"]["median"] == pytest.approx(2.0)
    assert best["llama.cpp Q8_0"] is None  # nothing of bitserve's is as good as 24.9


def test_bf16_arm_fails_by_name_where_bitserve_has_no_bf16_weights(monkeypatch):
    from bitserve.llm.config import EngineConfig

    arm = next(a for a in ls.MODES["recommended"] if a.name == "bitserve bf16")
    monkeypatch.delattr(EngineConfig, "weight_dtype", raising=False)
    assert "no bf16-weight path" in ls.unsupported(arm)
    monkeypatch.setattr(EngineConfig, "weight_dtype", property(lambda self: None), raising=False)
    assert ls.unsupported(arm) is None


def test_matched_arms_are_fp32_throughout_and_llama_server_kv_follows_the_arm(tmp_path):
    for arm in ls.MODES["matched"]:
        assert (arm.dtype, arm.kv) == ("float32", "f32")
    kinds = {}
    for arm in (a for mode in ls.MODES.values() for a in mode if a.server == "llamacpp"):
        server = ls.llamacpp_server(tmp_path / "llama-server", tmp_path / "m.gguf", arm.kv,
                                    {0}, 1, 16, 256)  # fmt: skip
        cmd = server.cmd
        kinds[arm.weights] = (
            cmd[cmd.index("--cache-type-k") + 1],
            cmd[cmd.index("--cache-type-v") + 1],
        )
        server.log.unlink()
    assert kinds == {"f32": ("f32", "f32"), "Q4_K_M": ("f16", "f16"), "Q8_0": ("f16", "f16")}


def test_bitserve_serves_the_gguf_file_itself_and_bf16_asks_for_it(tmp_path):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    arms = {a.name: a for a in ls.MODES["recommended"]}
    repo = ls.bitserve_repository(tmp_path / "repo", arms["bitserve Q4_K_M"], gguf)
    version = repo / "llama" / "1"
    assert [p.name for p in version.iterdir()] == [gguf.name]
    assert (version / gguf.name).resolve() == gguf.resolve()
    text = (repo / "llama" / "config.toml").read_text()
    assert "dtype" not in text and "gguf_activations" not in text  # the default: int8 x
    repo = ls.bitserve_repository(tmp_path / "repo", arms["bitserve Q4_K_M x fp32"], gguf)
    config = tomllib.loads((repo / "llama" / "config.toml").read_text())
    assert config["parameters"]["gguf_activations"] == "fp32"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    repo = ls.bitserve_repository(tmp_path / "repo", arms["bitserve bf16"], hf)

    config = tomllib.loads((repo / "llama" / "config.toml").read_text())
    assert config["parameters"]["dtype"] == "bfloat16"
    assert [p.name for p in (repo / "llama" / "1").iterdir()] == ["config.json"]


def write_gguf(path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a.weight", np.zeros((4, 32), np.float32))
    writer.add_tensor("b.weight", np.zeros((4, 32), np.float32))
    writer.add_tensor("c.weight", np.zeros((4, 32), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_json_names_each_arms_precision_its_gguf_types_and_the_cpu(tmp_path):
    pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    write_gguf(path)
    arm = ls.Arm("llama.cpp Q4_K_M", "llamacpp", "Q4_K_M", "float32", "f16")
    row = ls.describe(arm, path)
    assert row == {"name": "llama.cpp Q4_K_M", "server": "llamacpp", "weights": "Q4_K_M",
                   "dtype": "float32", "kv": "f16", "params": {}, "path": str(path),
                   "gguf_tensor_types": {"F16": 1, "F32": 2}}  # fmt: skip
    exact = next(a for a in ls.MODES["recommended"] if a.name == "bitserve Q4_K_M x fp32")
    assert ls.describe(exact, path)["params"] == {"gguf_activations": "fp32"}  # in the JSON
    isa = ls.cpu_isa()
    assert isa["model"] and isa["cpus"] >= 1
    assert {"avx512f", "avx512_bf16", "avx512_vnni"} <= set(isa)
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    assert isa["avx512f"] == ("avx512f" in flags)


def test_windows_are_llama_perplexitys():
    """Consecutive ctx-token windows, the tail dropped, each starting with BOS."""
    tokens = list(range(1, 11))
    assert pp.windows(tokens, 4, bos=99) == [[99, 2, 3, 4], [99, 6, 7, 8]]
    assert pp.windows(tokens, 4, bos=None) == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_score_counts_only_the_second_half_of_each_window():
    """ctx 6: llama-perplexity scores tokens 4 and 5 of each window (first = 3)."""
    window = [None, -9.0, -9.0, -9.0, -1.0, -2.0]
    out = pp.score([window, window], 6)
    assert out["scored_tokens"] == 4 and out["windows"] == 2
    assert out["ppl"] == pytest.approx(math.exp(1.5))
    with pytest.raises(ValueError):
        pp.score([[None] * 6], 6)


def test_score_keeps_each_scored_tokens_nll():
    logprobs = [[None, -1.0, -2.0, -0.5], [None, -0.1, -3.0, -0.2]]
    result = pp.score(logprobs, 4)
    assert result["nll"] == [0.5, 0.2]  # tokens ctx/2 + 1 .. ctx - 1 of each window
    assert result["ppl"] == pytest.approx(math.exp(0.35))


def test_paired_comparison_of_two_arms_on_the_same_tokens():
    """A paired bootstrap over windows (scipy) against a paired t-interval of the
    windows' mean NLLs carried to perplexity (ppl x the NLL difference, to first order):
    two methods, one answer; an arm 1% worse in NLL shows, a copy with noise does not."""
    from scipy import stats

    rng = np.random.default_rng(0)
    windows, per = 160, 63
    base = rng.gamma(2.0, 1.6, (windows, per))  # per-token NLLs, mean ~3.2 (ppl ~25)
    worse = base + 0.03 + rng.normal(0, 0.05, base.shape)
    c = pp.paired(worse.ravel().tolist(), base.ravel().tolist(), windows)
    wa, wb = worse.mean(1), base.mean(1)
    assert c["difference"] == pytest.approx(math.exp(wa.mean()) - math.exp(wb.mean()))
    t = stats.ttest_rel(wa, wb)
    half = stats.t.ppf(0.975, windows - 1) * (wa - wb).std(ddof=1) / math.sqrt(windows)
    ppl = math.exp(wb.mean())
    want = [ppl * ((wa - wb).mean() - half), ppl * ((wa - wb).mean() + half)]
    assert c["ci95"] == pytest.approx(want, rel=0.1)
    assert c["ci95"][0] > 0 and c["p"] == pytest.approx(t.pvalue)
    same = base + rng.normal(0, 0.05, base.shape)
    d = pp.paired(same.ravel().tolist(), base.ravel().tolist(), windows)
    assert d["ci95"][0] < 0 < d["ci95"][1] and d["p"] > 0.05
    with pytest.raises(ValueError, match="different tokens"):
        pp.paired([1.0, 2.0], [1.0], 1)
    rows = {"x": {"ppl": 3.0}, "y": {"nll": [1.0], "windows": 1}}
    with pytest.raises(ValueError, match="x: no per-token NLL"):
        pp.compare(rows, "x", "y")
