"""Hours, not requests: a soak and chaos run against one `bitserve serve` (issue 35).

    python -m bench.soak --minutes 30 [--clients 3] [--concurrency 8] [--report DIR]
                         [--no-chaos] [--plant-leak] [--ray]

One server on the default repository (built into a temp copy, plus a process-isolated
copy of `mlp` for kill -9, a second `mlp` version behind a canary split, and a spare
model that the admin API unloads and loads again), and several client processes that
keep it saturated with a mix of everything users send: v2 JSON, v2 binary and gRPC on
the batched models, OpenAI chat and completions (streamed and not, structured outputs),
embeddings, images, detector inputs, streams the client drops after the first chunk,
deadlines that expire in the queue, and bad input. Each request's outcome is recorded
by the client that sent it.

Chaos, spread over the run, one event at a time in turn: kill -9 of the
process-isolated instance (the server restarts it); a fault in the LLM engine's step
(its `fault_hook`, set through BITSERVE_LLM_FAULT_HOOK to `engine_fault` below): the
step's first request fails alone with a 500, the others go on; the engine's step loop
killed (the supervisor revives it: requests in flight get 503 with Retry-After); admin
unload/load of the spare model; a version swap of mlp's canary (promote: version 2
takes all traffic, then the canary policy again); a `bitserve batch` job over the same
repository beside the server (every row answered); and a SIGTERM drain at the end
(requests in flight finish, the process exits 0). Every event is logged with the
requests that overlapped it, by model and outcome. `--ray` adds `mlp_ray`, mlp as two
Ray replicas on a private Ray (`serve --ray local`), in the v2 JSON mix, and one more
event: kill -9 of a replica's actor process (its batch gets 503 with Retry-After, the
other replica serves on, a replacement starts). Not in the 2-minute `make test` run:
Ray's start alone would take a quarter of it.

Every `--sample` seconds the server's RSS (with its children), open file descriptors
and threads, and its own metrics (KV blocks in use, queue depths, in-flight requests)
go into a timeline. Pass means:
- every request ended by its deadline (none hung) and none got a 5xx other than a
  503 with Retry-After while a chaos event was touching its model;
- the server process's RSS after warm-up (the first third of the run, at most 5
  minutes) grows less than the bound per hour: the slope of a least-squares fit with
  its 95% confidence interval (scipy), the interval's upper end under the bound, which
  is derived from the run itself (2% of the warm RSS per hour, at least 64 MiB/h) or
  given (`--rss-bound`: a 2-minute run cannot resolve allocator warm-up from a slow
  leak, only a fast one);
- file descriptors and threads flat: the last quarter's peak at most the first
  quarter's plus max(4, 5% of the median) (their fitted slopes are reported too);
- the KV cache idle once traffic stops, and the server's own success counters equal
  to what the clients counted, per model;
- `--overload` chats at once on tinylm once traffic stops (each sent once, on a
  connection opened first): the refused ones' 429 within 50 ms p99, `live` 200 all along.
It writes `soak.json` (summary and timeline), `soak.png` (the timeline with the chaos
events) and prints the summary table. `--plant-leak` adds a python model that keeps
1 MiB per request, and sends it traffic: the run must then fail on RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "soak-admin"
LEAK_MODEL = """
import numpy as np

KEPT = []  # the planted leak: one buffer per request, never freed


class Model:
    def predict(self, inputs):
        KEPT.append(np.ones(1 << 20, dtype=np.uint8))
        return {"y": inputs["x"] * 2}
"""
LEAK_CONFIG = """backend = "python"
max_batch_size = 8
[[input]]
name = "x"
datatype = "FP32"
dims = [4]
[[output]]
name = "y"
datatype = "FP32"
dims = [4]
"""


FAULTS_ENV = "BITSERVE_SOAK_FAULTS"  # the folder where the soak asks for engine faults
_victims: set[str] = set()


def engine_fault(seqs: list) -> None:
    """The LLM engine's fault hook in the soak's server (called before each step with
    the step's sequences). A file `fail` in $BITSERVE_SOAK_FAULTS makes the step's first
    request the victim: every step it is in raises (the engine runs the batch again one
    request at a time and fails the victim alone); its id is appended to `victims`. A
    file `kill` kills the step loop (SystemExit is not isolated)."""
    folder = os.environ.get(FAULTS_ENV)
    if folder is None:
        return
    if _victims and any(s.request_id in _victims for s in seqs):
        raise RuntimeError("soak: injected fault")
    asked = os.listdir(folder)
    if "kill" in asked:
        os.remove(os.path.join(folder, "kill"))
        raise SystemExit("soak: the step loop is killed")
    if "fail" in asked and seqs:
        os.remove(os.path.join(folder, "fail"))
        _victims.add(seqs[0].request_id)
        with open(os.path.join(folder, "victims"), "a") as f:
            f.write(seqs[0].request_id + "\n")
        raise RuntimeError("soak: injected fault")


# -- the repository and the server ----------------------------------------------------
def build_repository(root: Path, plant_leak: bool, ray: bool = False) -> Path:
    repo = root / "models"
    shutil.copytree(ROOT / "models", repo, symlinks=True)
    for report in repo.glob("*/report"):
        shutil.rmtree(report)
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_models.py"), "--repository", str(repo)],
        check=True,
        capture_output=True,
    )
    mlp = (repo / "mlp" / "config.toml").read_text()
    # a canary: version 2 (the same weights) answers 20% of mlp's requests
    shutil.copytree(repo / "mlp" / "1", repo / "mlp" / "2")
    (repo / "mlp" / "config.toml").write_text(
        mlp + "\n[version_policy]\nall = true\n[traffic]\nstable = 1\ncanary = 2\n"
        "canary_weight = 20\n"
    )
    # kill -9 target: the same model in a child process
    proc = repo / "mlp_proc"
    proc.mkdir()
    shutil.copytree(repo / "mlp" / "1", proc / "1")
    (proc / "config.toml").write_text(mlp + '\n[instance_group]\nisolation = "process"\n')
    if ray:  # Ray actor kill target: two replicas, so one serves while the other restarts
        shutil.copytree(repo / "mlp" / "1", repo / "mlp_ray" / "1")
        (repo / "mlp_ray" / "config.toml").write_text(
            mlp + '\n[instance_group]\nisolation = "ray"\ncount = 2\nnum_cpus = 0.5\n'
        )
    # admin unload/load target
    shutil.copytree(repo / "bow_classifier", repo / "bow_spare")
    if plant_leak:
        (repo / "leaky" / "1").mkdir(parents=True)
        (repo / "leaky" / "1" / "model.py").write_text(LEAK_MODEL)
        (repo / "leaky" / "config.toml").write_text(LEAK_CONFIG)
    return repo


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    repo: Path, log: Path, threads: int, faults: Path, ray: bool = False
) -> tuple[subprocess.Popen, str, str]:
    import httpx

    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "bitserve.cli", "serve", "--repository", str(repo)]
    cmd += ["--port", str(port), "--grpc-port", str(grpc_port), "--admin-token", TOKEN]
    cmd += ["--threads", str(threads), "--model-control", "explicit", "--load-model", "*"]
    cmd += ["--ray", "local"] if ray else []
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), PYTHONPATH=path)
    env |= {"BITSERVE_LLM_FAULT_HOOK": "bench.soak:engine_fault", FAULTS_ENV: str(faults)}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None or "NOT ready" in log.read_text():
            proc.kill()
            raise RuntimeError(f"server not ready:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                return proc, url, f"127.0.0.1:{grpc_port}"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not ready:\n{log.read_text()[-3000:]}")


# -- the process tree, read from /proc ------------------------------------------------
def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo += children(p)
    return pids


def proc_stats(pid: int) -> dict:
    """The server process's RSS, fds and threads, and its children's RSS apart: chaos
    kills and restarts children, so their sum is a saw, not a trend."""
    out = {"rss": 0, "rss_children": 0, "fds": 0, "threads": 0}
    for p in tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            rss = int(fields["VmRSS"].split()[0]) * 1024
            if p == pid:
                out |= {"rss": rss, "threads": int(fields["Threads"])}
                out["fds"] = len(os.listdir(f"/proc/{p}/fd"))
            else:
                out["rss_children"] += rss
        except (OSError, KeyError, ValueError):
            pass  # a child that just exited
    return out


def ray_replicas() -> list[int]:
    """The pids of the Ray replica actors' worker processes (titled `ray::ReplicaActor`)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if cmdline.read_bytes().startswith(b"ray::ReplicaActor"):
                pids.append(int(cmdline.parent.name))
    return sorted(pids)


def process_instance(pid: int) -> int | None:
    """The pid of the process-isolated instance (a multiprocessing spawn child)."""
    for p in children(pid):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            return p
    return None


def scrape(url: str) -> dict:
    """The server's own gauges and counters that the soak reads."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict = {"kv_usage": 0.0, "queue": 0.0, "inflight": 0.0, "success": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "bitserve_llm_kv_cache_usage_perc":
                out["kv_usage"] = max(out["kv_usage"], s.value)
            elif s.name == "bitserve_queue_depth":
                out["queue"] += s.value
            elif s.name == "bitserve_inflight_requests":
                out["inflight"] += s.value
            elif (
                s.name == "bitserve_request_success_total"
                or s.name == "bitserve_llm_request_success_total"
            ):
                model = s.labels.get("model")
                out["success"][model] = out["success"].get(model, 0) + s.value
    return out


# -- the clients ----------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str
    protocol: str
    model: str
    start: float  # wall clock (time.time), so that processes agree
    seconds: float
    status: int  # HTTP status; 0: no answer in time; -1: we disconnected on purpose
    retry_after: bool = False
    expected: str = "ok"  # ok, error (bad input), deadline, disconnect


def v2_json(model: str, name: str, x: np.ndarray, datatype: str = "FP32") -> dict:
    return {
        "inputs": [
            {"name": name, "datatype": datatype, "shape": list(x.shape), "data": x.ravel().tolist()}
        ]
    }


def v2_binary(name: str, x: np.ndarray) -> tuple[bytes, dict]:
    header = {
        "inputs": [
            {
                "name": name,
                "datatype": "FP32",
                "shape": list(x.shape),
                "parameters": {"binary_data_size": x.nbytes},
            }
        ],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }
    head = json.dumps(header).encode()
    return head + x.tobytes(), {"Inference-Header-Content-Length": str(len(head))}


BAD_BODIES = [
    b"{",
    b"[]",
    b'{"inputs": 5}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 512], "data": "no"}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1, 512], "data": [1]}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 99999999999], "data": []}]}',
    b'{"model": "tinylm", "messages": "hi"}',
    b'{"model": "tinylm", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}',
    b'{"model": "tinylm", "prompt": "x", "temperature": "hot"}',
    b'{"model": "nope", "prompt": "x"}',
]


async def one_request(client, grpc_client, kind: str, rng: random.Random, plant_leak: bool):
    """Send one request of `kind`; returns (protocol, model, response or status, expected)."""
    if kind == "v2_json":
        model = rng.choice(["mlp", "mlp_proc", *(["mlp_ray"] if RAY_MIX else [])])
        x = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
            (1, 512), dtype=np.float32
        )
        r = await client.post(f"/v2/models/{model}/infer", json=v2_json(model, "x", x))
        return "v2-json", model, r, "ok"
    if kind == "v2_binary":
        x = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
            (4, 512), dtype=np.float32
        )
        body, headers = v2_binary("x", x)
        r = await client.post("/v2/models/mlp/infer", content=body, headers=headers)
        return "v2-binary", "mlp", r, "ok"
    if kind == "grpc":
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.utils import InferenceServerException

        x = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
            (2, 512), dtype=np.float32
        )
        tensor = grpcclient.InferInput("x", [2, 512], "FP32")
        tensor.set_data_from_numpy(x)
        try:
            await grpc_client.infer("mlp", [tensor], client_timeout=30)
            return "grpc", "mlp", 200, "ok"
        except InferenceServerException as e:
            return "grpc", "mlp", grpc_status(e), "ok"
    if kind == "bow":
        ids = np.array([[rng.randrange(1000) for _ in range(rng.randrange(1, 24))]], dtype=np.int64)
        body = v2_json("bow", "input_ids", ids, "INT64")
        model = "bow_spare" if rng.random() < 0.3 else "bow_classifier"
        r = await client.post(f"/v2/models/{model}/infer", json=body)
        return "v2-json", model, r, "ok"
    if kind in ("chat", "chat_stream", "completion_stream", "structured", "disconnect"):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12)))
        body: dict = {"model": "tinylm", "max_tokens": rng.randrange(4, 32)}
        if kind == "completion_stream":
            path, body["prompt"], body["stream"] = "/v1/completions", words, True
        else:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
            body["stream"] = kind in ("chat_stream", "disconnect")
        if kind == "structured":
            body["response_format"] = {"type": "json_object"}
            body["max_tokens"] = 48
        if rng.random() < 0.5:
            body |= {"temperature": 0.8, "seed": rng.randrange(1000)}
        if not body["stream"]:
            r = await client.post(path, json=body)
            return "openai", "tinylm", r, "ok"
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200 or kind != "disconnect":
                async for _ in r.aiter_lines():
                    pass
                return "openai-stream", "tinylm", r, "ok"
            async for _ in r.aiter_lines():
                break  # the client goes away after the first chunk
        return "openai-stream", "tinylm", -1, "disconnect"
    if kind == "embeddings":
        inputs = [" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(rng.randrange(1, 4))]
        r = await client.post("/v1/embeddings", json={"model": "minilm", "input": inputs})
        return "openai", "minilm", r, "ok"
    if kind == "image":
        x = {"prompt": str(rng.randrange(10)), "model": "digits", "n": 1, "steps": 8}
        r = await client.post("/v1/images/generations", json=x)
        return "openai", "digits", r, "ok"
    if kind == "detector":
        image = np.random.default_rng(rng.randrange(1 << 30)).integers(
            0, 255, (1, 64, 64, 1), dtype=np.uint8
        )
        r = await client.post(
            "/v2/models/detector/infer", json=v2_json("detector", "image", image, "UINT8")
        )
        return "v2-json", "detector", r, "ok"
    if kind == "deadline":  # Triton's timeout parameter (microseconds), far below a batch
        x = np.zeros((64, 512), dtype=np.float32)
        body = v2_json("mlp", "x", x) | {"parameters": {"timeout": 1}}
        r = await client.post("/v2/models/mlp/infer", json=body)
        return "v2-json", "mlp", r, "deadline"
    if kind == "bad":
        body = rng.choice(BAD_BODIES)
        path = "/v1/chat/completions" if b"model" in body else "/v2/models/mlp/infer"
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        return "bad-input", "mlp" if "v2" in path else "tinylm", r, "error"
    if kind == "leak" and plant_leak:
        x = np.ones((1, 4), dtype=np.float32)
        r = await client.post("/v2/models/leaky/infer", json=v2_json("leaky", "x", x))
        return "v2-json", "leaky", r, "ok"
    raise ValueError(kind)


def grpc_status(e) -> int:
    """tritonclient's gRPC error as the HTTP status bitserve maps it to."""
    status = str(e.status() or "")
    return {
        "StatusCode.UNAVAILABLE": 503,
        "StatusCode.RESOURCE_EXHAUSTED": 429,
        "StatusCode.DEADLINE_EXCEEDED": 504,
        "StatusCode.INVALID_ARGUMENT": 400,
        "StatusCode.NOT_FOUND": 404,
    }.get(status, 500)


WORDS = [
    "the",
    "lord",
    "is",
    "my",
    "shepherd",
    "i",
    "shall",
    "not",
    "want",
    "he",
    "maketh",
    "me",
    "to",
    "lie",
    "down",
    "in",
    "green",
    "pastures",
]
RAY_MIX = False  # a client process sends mlp_ray its share of v2 JSON (--ray)
MIX = {
    "v2_json": 10,
    "v2_binary": 6,
    "grpc": 6,
    "bow": 6,
    "chat": 6,
    "chat_stream": 6,
    "completion_stream": 4,
    "structured": 2,
    "disconnect": 3,
    "embeddings": 4,
    "image": 2,
    "detector": 3,
    "deadline": 2,
    "bad": 4,
    "leak": 12,
}


def client_main(
    url: str,
    grpc_target: str,
    seconds: float,
    concurrency: int,
    seed: int,
    out: str,
    plant_leak: bool,
    ray: bool = False,
):
    """One client process: `concurrency` loops sending the mix until `seconds` pass."""
    import httpx
    import tritonclient.grpc.aio as grpcclient

    global RAY_MIX
    RAY_MIX = ray

    mix = {k: w for k, w in MIX.items() if k != "leak" or plant_leak}
    kinds, weights = list(mix), list(mix.values())
    results: list[Outcome] = []
    end = time.monotonic() + seconds

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        timeout = httpx.Timeout(30.0)
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            grpc_client = grpcclient.InferenceServerClient(grpc_target)
            while time.monotonic() < end:
                kind = rng.choices(kinds, weights)[0]
                t0, wall = time.monotonic(), time.time()
                try:
                    protocol, model, r, expected = await one_request(
                        client, grpc_client, kind, rng, plant_leak
                    )
                    status = r if isinstance(r, int) else r.status_code
                    retry = not isinstance(r, int) and "retry-after" in r.headers
                except (TimeoutError, httpx.TimeoutException):
                    protocol, model, status, retry, expected = kind, "?", 0, False, "ok"
                except httpx.HTTPError:  # the server closed the connection (drain, kill)
                    protocol, model, status, retry, expected = kind, "?", -2, False, "ok"
                results.append(
                    Outcome(
                        kind, protocol, model, wall, time.monotonic() - t0, status, retry, expected
                    )
                )
            await grpc_client.close()

    async def main() -> None:
        await asyncio.gather(*(loop(i) for i in range(concurrency)))

    asyncio.run(main())
    Path(out).write_text(json.dumps([asdict(r) for r in results]))


# -- chaos ----------------------------------------------------------------------------
@dataclass
class Event:
    name: str
    start: float
    end: float
    models: list[str]
    detail: str = ""
    failures: int = 0  # requests the event fails on purpose (500): engine step faults
    ok: bool = True  # the event did what it should (a batch job answered every row)
    affected: dict | None = None  # outcomes of the requests that overlapped it, by label


CANARY = {"stable": 1, "canary": 2, "canary_weight": 20}  # mlp's policy in its config
BATCH_ROWS = 200


def chaos(
    server_pid: int,
    url: str,
    repo: Path,
    faults: Path,
    events: list[Event],
    stop: threading.Event,
    interval: float,
    ray: bool = False,
) -> None:
    """One chaos event every `interval` seconds, each kind in turn, until `stop`."""
    import httpx

    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)

    def ready(model: str) -> bool:
        return http.get(f"/v2/models/{model}/ready", timeout=5).status_code == 200

    def until(done: Callable[[], bool], seconds: float = 120) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not stop.is_set():
            if done():
                return True
            time.sleep(0.2)
        return False

    def kill_instance() -> Event:
        start, pid = time.time(), process_instance(server_pid)
        if pid is None:
            return Event("kill -9 instance", start, time.time(), ["mlp_proc"], "no child found")
        os.kill(pid, signal.SIGKILL)  # the server replaces it: the event lasts until ready
        until(lambda: process_instance(server_pid) not in (None, pid) and ready("mlp_proc"))
        return Event("kill -9 instance", start, time.time() + 1.0, ["mlp_proc"], f"pid {pid}")

    def kill_ray_replica() -> Event:
        start, before = time.time(), ray_replicas()
        if not before:
            return Event(
                "kill -9 Ray replica", start, time.time(), ["mlp_ray"], "none found", ok=False
            )
        os.kill(before[0], signal.SIGKILL)  # the server starts a replacement where Ray has room
        back = until(lambda: len(set(ray_replicas()) - {before[0]}) >= len(before), 180)
        detail = f"pid {before[0]} of {len(before)}, " + ("replaced" if back else "NOT replaced")
        return Event("kill -9 Ray replica", start, time.time() + 1.0, ["mlp_ray"], detail, ok=back)

    def engine_fault() -> Event:
        start, victims = time.time(), faults / "victims"
        before = victims.read_text().count("\n") if victims.exists() else 0
        (faults / "fail").touch()  # taken by the next step with a request in it
        until(lambda: not (faults / "fail").exists(), 60)
        after = victims.read_text().count("\n") if victims.exists() else 0
        failed = after - before
        detail = f"{failed} request failed (500)"
        return Event("engine step fault", start, time.time() + 1.0, ["tinylm"], detail, failed)

    def engine_loop_kill() -> Event:
        start = time.time()
        (faults / "kill").touch()
        until(lambda: not (faults / "kill").exists(), 60)
        killed = time.time()
        if until(lambda: not ready("tinylm"), 10):  # the supervisor's restart began
            until(lambda: ready("tinylm"))
            detail = f"loop killed, not ready for {time.time() - killed:.1f} s"
        else:  # /ready said 200 at every poll for 10 s: the revival was quicker than a poll
            detail = "loop killed, ready at every 0.2 s poll for 10 s after"
        return Event("engine loop kill", start, time.time() + 1.0, ["tinylm"], detail)

    def unload_load() -> Event:
        start = time.time()
        r1 = http.post("/v2/repository/models/bow_spare/unload")
        time.sleep(interval / 4)
        r2 = http.post("/v2/repository/models/bow_spare/load")
        detail = f"unload {r1.status_code}, load {r2.status_code}"
        return Event("unload/load", start, time.time() + 1.0, ["bow_spare"], detail)

    def version_swap() -> Event:
        start, base = time.time(), "/v2/repository/models/mlp/traffic"
        r1 = http.post(base + "/promote")  # version 2 takes all of mlp's traffic
        time.sleep(interval / 4)
        r2 = http.put(base, json=CANARY)  # and 80/20 again
        stable = r1.json().get("stable") if r1.status_code == 200 else r1.text[:100]
        detail = f"promote {r1.status_code} (stable {stable}), canary again {r2.status_code}"
        return Event("version swap", start, time.time() + 1.0, ["mlp"], detail)

    def batch_job() -> Event:
        start, folder = time.time(), faults / f"batch-{len(events)}"
        folder.mkdir()
        rng = np.random.default_rng(len(events))
        lines = ["id,x"] + [
            f'r{i},"{json.dumps(rng.standard_normal(512).round(3).tolist())}"'
            for i in range(BATCH_ROWS)
        ]
        (folder / "rows.csv").write_text("\n".join(lines) + "\n")
        cmd = [sys.executable, "-m", "bitserve.cli", "batch", "--repository", str(repo)]
        cmd += ["--input", str(folder / "rows.csv"), "--output", str(folder / "out.jsonl")]
        cmd += ["--model", "mlp", "--map", "x=x", "--id-column", "id", "--threads", "1"]
        run = subprocess.run([*cmd, "--no-progress"], capture_output=True, text=True, timeout=300)
        out = folder / "out.jsonl"
        docs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        answered = sum((d.get("response") or {}).get("status_code") == 200 for d in docs)
        detail = f"exit {run.returncode}, {answered}/{BATCH_ROWS} rows answered"
        ok = run.returncode == 0 and answered == BATCH_ROWS
        return Event("batch job", start, time.time(), [], detail + ("" if ok else " FAILED"), ok=ok)

    # the quick ones first: a 2-minute run on a loaded box may only get to four
    kinds = [engine_fault, version_swap, kill_instance, engine_loop_kill, unload_load, batch_job]
    kinds += [kill_ray_replica] if ray else []
    turn = 0
    while not stop.wait(interval):
        try:
            events.append(kinds[turn % len(kinds)]())
        except Exception as e:  # the event itself broke: logged, and the run fails
            name = kinds[turn % len(kinds)].__name__
            events.append(Event(name, time.time(), time.time(), [], f"{e!r}", ok=False))
        turn += 1
    http.close()


# -- the timeline and the verdict -----------------------------------------------------
def sampler(pid: int, url: str, timeline: list[dict], stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        row = {"t": time.time(), **proc_stats(pid)}
        try:
            m = scrape(url)
            row |= {k: m[k] for k in ("kv_usage", "queue", "inflight")}
        except Exception:
            pass
        timeline.append(row)


def slope_per_hour(t: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least-squares slope in units per hour, with its 95% confidence interval."""
    from scipy import stats

    if len(t) < 3 or np.ptp(t) == 0:
        return 0.0, 0.0, 0.0
    if np.ptp(y) == 0:  # flat: the fit's stderr is 0/0
        return 0.0, 0.0, 0.0
    fit = stats.linregress(t, y)
    half = stats.t.ppf(0.975, len(t) - 2) * fit.stderr
    return fit.slope * 3600, (fit.slope - half) * 3600, (fit.slope + half) * 3600


def touches(o: dict, e: Event, grace: float = 2.0) -> bool:
    """The request overlapped the event, on a model the event touched."""
    end = o["start"] + o["seconds"]
    return (
        (o["model"] in e.models or (o["model"] == "?" and bool(e.models)))
        and o["start"] <= e.end + grace
        and end >= e.start - grace
    )


def in_event(o: dict, events: list[Event], grace: float = 2.0) -> bool:
    return any(touches(o, e, grace) for e in events)


def verdict(
    outcomes: list[dict],
    rss_bound: float | None,
    timeline: list[dict],
    events: list[Event],
    warm_s: float,
    counters: dict,
    kv_idle: float,
    drain: dict,
    overload: dict | None = None,
) -> dict:
    t0 = timeline[0]["t"] if timeline else 0.0
    warm = [r for r in timeline if r["t"] - t0 >= warm_s]
    checks: dict = {}
    t = np.array([r["t"] for r in warm])
    y = np.array([r["rss"] for r in warm], dtype=float)
    median = float(np.median(y)) if len(y) else 0.0
    bound = rss_bound if rss_bound is not None else max(0.02 * median, 64 * 2**20)
    slope, low, high = slope_per_hour(t, y)
    checks["rss"] = {
        "median": median,
        "slope_per_hour": slope,
        "ci95": [low, high],
        "bound_per_hour": bound,
        "ok": bool(high < bound),
    }
    for key in ("fds", "threads"):  # flat: the last quarter's peak near the first's
        y = np.array([r[key] for r in warm], dtype=float)
        q = max(1, len(y) // 4)
        first, last = (float(y[:q].max()), float(y[-q:].max())) if len(y) else (0.0, 0.0)
        tolerance = max(4.0, 0.05 * float(np.median(y))) if len(y) else 4.0
        slope, low, high = slope_per_hour(t, y)
        checks[key] = {
            "first_quarter_max": first,
            "last_quarter_max": last,
            "tolerance": tolerance,
            "slope_per_hour": slope,
            "ci95": [low, high],
            "ok": last <= first + tolerance,
        }
    by = Counter()
    bad = []
    owed = [e.failures for e in events]  # the 500s each event may still account for
    for o in outcomes:
        status, expected = o["status"], o["expected"]
        if expected == "disconnect":
            label = "disconnected"
        elif status == 0:
            label = "no answer"
        elif status == -2:
            label = "connection lost"
        elif expected == "error" and not (status == 503 and o["retry_after"]):
            label = "4xx" if 400 <= status < 500 else f"{status} (should be 4xx)"
        elif expected == "deadline":
            label = "deadline" if status in (200, 504) else f"{status}"
        elif 200 <= status < 300:
            label = "ok"
        elif status in (429, 503) and o["retry_after"]:
            label = f"{status} retry-after"
        else:
            label = str(status)
        o["label"] = label
        by[(o["protocol"], label)] += 1
        allowed = label in ("ok", "disconnected", "4xx", "deadline", "429 retry-after")
        if label == "503 retry-after" or label in ("connection lost", "503", "404"):
            allowed = in_event(o, events)
        if label == "500":  # owed only to an engine step fault, one per request it failed
            faults = [i for i, e in enumerate(events) if owed[i] and touches(o, e)]
            allowed = bool(faults)
            if faults:
                owed[faults[0]] -= 1
        if not allowed:
            bad.append(o)
    checks["requests"] = {"ok": not bad, "unexpected": len(bad), "examples": bad[:10]}
    broken = [f"{e.name}: {e.detail}" for e in events if not e.ok]
    checks["chaos"] = {"ok": not broken, "events": len(events), "failed": broken}
    client_ok = Counter(o["model"] for o in outcomes if 200 <= o["status"] < 300)
    disconnected = Counter(o["model"] for o in outcomes if o["expected"] == "disconnect")
    mismatch = {}
    for model, n in client_ok.items():
        if model in ("tinylm", "minilm", "digits") or model.startswith("bow_spare"):
            continue  # OpenAI counts and disconnects, or a reload resets the counter
        server = counters.get(model, 0)
        if server != n:
            mismatch[model] = {"server": server, "clients": n}
    checks["counters"] = {
        "ok": not mismatch,
        "mismatch": mismatch,
        "disconnected": dict(disconnected),
    }
    checks["kv_idle"] = {"ok": kv_idle == 0.0, "kv_usage_after": kv_idle}
    checks["drain"] = drain
    if overload is not None:
        checks["overload"] = overload
    return {
        "ok": all(c.get("ok", False) for c in checks.values()),
        "checks": checks,
        "outcomes": {f"{p} {lab}": n for (p, lab), n in sorted(by.items())},
    }


def affected(events: list[Event], outcomes: list[dict]) -> None:
    """Each event's `affected`: the outcomes (model and label, as `verdict` set them) of
    the requests that overlapped it on its models; on any model for an event that
    touches none (a batch job competes for the CPU)."""
    for e in events:
        hits = Counter()
        for o in outcomes:
            end = o["start"] + o["seconds"]
            overlaps = o["start"] <= e.end and end >= e.start
            if touches(o, e, 0.0) if e.models else overlaps:
                hits[f"{o['model']} {o.get('label', o['status'])}"] += 1
        e.affected = dict(sorted(hits.items()))


def plot(timeline: list[dict], events: list[Event], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = timeline[0]["t"]
    t = [(r["t"] - t0) / 60 for r in timeline]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    series = [
        ("RSS (MiB)", None),
        ("open fds / threads", None),
        ("KV usage", [r.get("kv_usage", 0) for r in timeline]),
        ("queued / in flight", None),
    ]
    for ax, (label, ys) in zip(axes, series, strict=True):
        if label.startswith("RSS"):
            ax.plot(t, [r["rss"] / 2**20 for r in timeline], label="server")
            ax.plot(t, [r["rss_children"] / 2**20 for r in timeline], label="children")
            ax.legend(loc="upper left")
        elif label.startswith("open"):
            ax.plot(t, [r["fds"] for r in timeline], label="fds")
            ax.plot(t, [r["threads"] for r in timeline], label="threads")
            ax.legend(loc="upper left")
        elif label.startswith("queued"):
            ax.plot(t, [r.get("queue", 0) for r in timeline], label="queued")
            ax.plot(t, [r.get("inflight", 0) for r in timeline], label="in flight")
            ax.legend(loc="upper left")
        else:
            ax.plot(t, ys)
        ax.set_ylabel(label)
        for e in events:
            ax.axvspan((e.start - t0) / 60, (e.end - t0) / 60, color="red", alpha=0.15)
    axes[-1].set_xlabel("minutes (red: chaos events)")
    fig.suptitle("bitserve soak")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=3, help="client processes")
    parser.add_argument("--concurrency", type=int, default=8, help="request loops per client")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--sample", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--report", type=Path, default=ROOT / "bench" / "results" / "soak")
    parser.add_argument("--no-chaos", action="store_true")
    parser.add_argument("--overload", type=int, default=400, help="chats at once (0: none)")
    parser.add_argument(
        "--rss-bound",
        type=float,
        default=None,
        help="MiB/h the server's RSS may grow (default: 2%% of its warm RSS, at least 64)",
    )
    parser.add_argument(
        "--plant-leak", action="store_true", help="a model that leaks 1 MiB a request"
    )
    parser.add_argument("--ray", action="store_true", help="Ray replicas, and an actor killed")
    args = parser.parse_args(argv)
    seconds = args.minutes * 60
    args.report.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bitserve-soak-"))
    repo = build_repository(work, args.plant_leak, args.ray)
    faults = work / "faults"
    faults.mkdir()
    server, url, grpc_target = start_server(
        repo, args.report / "server.log", args.threads, faults, args.ray
    )
    timeline: list[dict] = []
    events: list[Event] = []
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=sampler, args=(server.pid, url, timeline, stop, args.sample), daemon=True
        )
    ]
    if not args.no_chaos:
        interval = max(10.0, seconds / 16)
        chaos_args = (server.pid, url, repo, faults, events, stop, interval, args.ray)
        threads.append(threading.Thread(target=chaos, args=chaos_args, daemon=True))
    for th in threads:
        th.start()
    ctx = multiprocessing.get_context("spawn")
    files = [work / f"client-{i}.json" for i in range(args.clients)]
    clients = [
        ctx.Process(
            target=client_main,
            args=(
                url,
                grpc_target,
                seconds,
                args.concurrency,
                i,
                str(f),
                args.plant_leak,
                args.ray,
            ),
        )
        for i, f in enumerate(files)
    ]
    for c in clients:
        c.start()
    for c in clients:
        c.join(seconds + 120)
    stop.set()
    for th in threads:
        th.join(150)
    outcomes = [o for f in files if f.exists() for o in json.loads(f.read_text())]
    time.sleep(2.0)  # streams the clients dropped are cancelled by now
    after = scrape(url)
    overload = overload_probe(url, args.overload)
    drain = sigterm_drain(server, url)
    result = verdict(  # warm-up: a third of the run, at most 5 minutes
        outcomes,
        args.rss_bound * 2**20 if args.rss_bound else None,
        timeline,
        events,
        warm_s=min(300.0, seconds / 3),
        counters=after["success"],
        kv_idle=after["kv_usage"],
        drain=drain,
        overload=overload,
    )
    affected(events, outcomes)
    result |= {
        "minutes": args.minutes,
        "requests": len(outcomes),
        "events": [asdict(e) for e in events],
        "timeline": timeline,
    }
    (args.report / "soak.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    if timeline:
        plot(timeline, events, args.report / "soak.png")
    print_summary(result)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if result["ok"] else 1


def overload_probe(url: str, n: int, bound_ms: float = 50.0) -> dict:
    """`n` chats at once on tinylm (past its max_queued_requests), each sent once on a
    connection opened beforehand: the rejected ones' time to a 429 (to the kernel's
    receive time: bench/overload.py's timed_clients), its p99 under `bound_ms`, and `live`
    answering 200 meanwhile."""
    import httpx

    from bench.overload import chat_body, http_request, timed_clients

    if n <= 0:
        return {"ok": True, "skipped": True}
    port = int(url.rsplit(":", 1)[1])
    request = http_request("/v1/chat/completions", chat_body(64, False))
    live: list[int] = []
    done = threading.Event()

    def probe_live() -> None:
        with httpx.Client(base_url=url, timeout=10) as client:
            while not done.is_set():
                live.append(client.get("/v2/health/live").status_code)
                time.sleep(0.05)

    prober = threading.Thread(target=probe_live)
    prober.start()
    try:
        answers = timed_clients(port, request, n)
    finally:
        done.set()
        prober.join(30)
    statuses = Counter(str(a[0]) for a in answers)
    rejected = [a[1] for a in answers if a[0] == 429 and a[3]]
    p99 = float(np.percentile(rejected, 99)) if rejected else None
    return {
        "ok": bool(rejected) and p99 <= bound_ms and all(s == 200 for s in live),
        "requests": n,
        "statuses": dict(statuses),
        "rejected_p50_ms": float(np.percentile(rejected, 50)) if rejected else None,
        "rejected_p99_ms": p99,
        "bound_ms": bound_ms,
        "live_probes": len(live),
        "live_all_200": all(s == 200 for s in live),
    }


def sigterm_drain(server: subprocess.Popen, url: str) -> dict:
    """SIGTERM with a few requests in flight: they finish, then the process exits 0."""
    import httpx

    body = {"model": "tinylm", "prompt": "In the beginning", "max_tokens": 200}
    body |= {"ignore_eos": True}
    answers: list[int] = []

    def send() -> None:
        try:
            answers.append(httpx.post(url + "/v1/completions", json=body, timeout=60).status_code)
        except httpx.HTTPError:
            answers.append(0)

    senders = [threading.Thread(target=send) for _ in range(4)]
    for s in senders:
        s.start()
    time.sleep(1.0)  # every request is in flight: 200 tokens take longer
    server.send_signal(signal.SIGTERM)
    for s in senders:
        s.join(90)
    try:
        code = server.wait(90)
    except subprocess.TimeoutExpired:
        server.kill()
        code = None
    return {
        "ok": code == 0 and all(a == 200 for a in answers),
        "exit_code": code,
        "in_flight_answers": answers,
    }


def print_summary(result: dict) -> None:
    print(f"soak: {result['minutes']} min, {result['requests']} requests, pass={result['ok']}")
    for name, n in result["outcomes"].items():
        print(f"  {name:40s} {n:8d}")
    for e in result["events"]:
        print(f"  event {e['name']:20s} {e['end'] - e['start']:6.1f} s  {e['detail']}")
        print(f"        affected: {json.dumps(e['affected'])[:300]}")
    for name, c in result["checks"].items():
        extra = {k: v for k, v in c.items() if k not in ("examples",)}
        print(f"  {name:10s} {json.dumps(extra, default=float)[:200]}")


if __name__ == "__main__":
    sys.exit(main())
