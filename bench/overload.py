"""Time to a refusal under overload, per protocol (issue 35, item 5).

    .venv/bin/python -m bench.overload [--burst 400] [--rounds 3] [--streams 96]
        [--tree PATH ...]

One `bitserve serve` of models/tinylm alone (max_queued_requests 64). A child process
keeps `--streams` streamed chats of 200 tokens going (the engine saturated, the event
loop busy sending tokens). All 96 run at once (max_num_seqs is 256), so the waiting
queue is empty when a burst comes: each burst's first 64 requests are admitted (16
tokens each) and the rest refused. Both cost the refusals: the admitted ones' front door
(body, template, encoding) on the event loop, and the engine thread in the same process
(a burst of refusals alone costs the loop twice its idle CPU beside it, streamed or not,
and no more than idle when the saturating engine is a Ray replica's). Meanwhile bursts
of `--burst` requests arrive at once on each protocol: OpenAI chat over HTTP, v2 infer
over HTTP (text_input), v2 ModelInfer over gRPC. A refusal's time is from its request's
write to its status line (gRPC: to the call's end), on connections opened beforehand: a
refusal, not a handshake, is timed. `live` is polled all along. Beside the times, from
the server's schedstat: the event loop's CPU from a burst's first send to its last
refusal, and its time runnable but waiting for a CPU over the same span (what a loaded
box adds; the CPU figure it does not stretch). `--unstreamed` saturates with chats not
streamed.

`--hostile` measures item 4 instead: the p50/p99 of normal chats (a closed loop of 4
users, 16 tokens each) alone (clean), then beside 100 streams of 200 tokens (20 logprobs
a token) never read and 1,000 connections sending their headers or body a byte a second
(hostile); the timing starts once the engine runs nothing (the never-read streams' 200
tokens are computed whether read or not: on a loaded box that takes 10-40 s), so what the
ratio shows is what the stalled sockets and the slow connections cost the others. Each
slowloris connection opens again once the server closes it. The ratio of the two p99s
is the figure (issue 35: at most 1.2), per round, `--rounds` rounds on one server with
the clean and hostile order swapped every round.

`--isolation thread --isolation process` runs the same measurement with the tinylm
copies' engine in the server process and in a child process (llmprocess.py), one variant
each; `--refusals-only` sends the saturated bursts to the twin that refuses everything.
On the 2-core box (2026-12-05) the engine process doubled the saturating streams'
throughput (2050 against 1100 chunks/s; 3075 against 1840 with refusals only) but the
refusals' p99 stayed 60-140 ms: the loop still handles every step's outputs of the 96
chats (the router side), and the engine process takes the second core the loop used.

`--probe N` repeats the soak's overload probe (issue 35's check: `--burst` chats at once
on tinylm, the engine idle before each, 64 admitted and the rest refused) N times on
connections opened just before the burst and N times on connections the server has
accepted already, alternately (each with the loop's CPU per client of the burst, to its
last 429), then times the event loop's CPU per connection on `full`:
accepting it, reading a request and writing its 429, closing it (2026-12-05, this VM:
~27-41, ~40-68 and ~27 us: a burst of 400 new clients is ~40 ms of the loop before
anything else it does).

`--tree` runs the same measurement against the server code of another checkout (e.g.
`--tree . --tree /work/main`: after and before, in one run, on one box; with `--probe`
the trees' servers are up at once and their bursts interleaved, the order rotated). Prints a table
and a JSON line. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import multiprocessing
import os
import selectors
import shutil
import socket
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.server import Server, bitserve_command, free_port

ROOT = Path(__file__).resolve().parent.parent
CHAT = {"model": "tinylm", "messages": [{"role": "user", "content": "Who is my shepherd?"}]}


def chat_body(max_tokens: int, stream: bool, model: str = "tinylm") -> bytes:
    body = CHAT | {"model": model, "max_tokens": max_tokens, "ignore_eos": True}
    return json.dumps(body | {"stream": stream})


def v2_body(max_tokens: int) -> bytes:
    params = json.dumps({"max_tokens": max_tokens, "ignore_eos": True})
    inputs = [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Who is my shepherd?"]},
        {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": [params]},
    ]
    return json.dumps({"inputs": inputs})


def http_request(path: str, body: bytes | str, close: bool = False) -> bytes:
    body = body.encode() if isinstance(body, str) else body
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "")
    return head.encode() + b"\r\n" + body


def head_of(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}


# -- the saturating streams, in a process of their own ---------------------------------
def saturate(
    port: int, streams: int, seconds: float, stream: bool = True, chunks: Any = None
) -> None:
    """`streams` streamed chats (or not streamed: their text sent once, at the end),
    each started again when it ends (or 0.2 s after a 429). `chunks` (a shared counter)
    counts the streamed chunks received (about one a token): the admitted streams'
    throughput."""
    request = http_request("/v1/chat/completions", chat_body(200, stream), close=True)
    mark = b"data: {"

    async def one() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request)
                status, _ = head_of(await reader.readuntil(b"\r\n\r\n"))
                if status == 200:
                    tail = b""
                    while piece := await asyncio.wait_for(
                        reader.read(65536), end - time.monotonic()
                    ):
                        seen = tail + piece
                        if chunks is not None:
                            chunks.value += seen.count(mark)
                        tail = seen[-(len(mark) - 1) :]
                writer.close()
                if status != 200:
                    await asyncio.sleep(0.2)
            except (OSError, TimeoutError, asyncio.IncompleteReadError):
                await asyncio.sleep(0.2)

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(streams)))

    asyncio.run(main())


# -- the bursts ------------------------------------------------------------------------
SO_TIMESTAMPNS = 35  # Linux: the kernel's receive time of a segment, in recvmsg's ancdata


def timed_clients(
    port: int,
    request: bytes,
    n: int,
    retry: str = "once",
    seconds: float = 0.0,
    settle: float = 0.0,
) -> list[tuple[int, float, float, bool]]:
    """`n` keep-alive connections, opened beforehand (`settle` seconds before: the
    server has accepted them; 0: the burst meets their accepts), each sending `request`
    at once.
    `retry` is what a client does after an answer, until `seconds` pass: "once" nothing
    (a burst), "hammer" sends again at once, "retry-after" waits the Retry-After of a 429
    or 503 first (as the openai SDK does), then sends again.

    Each answer: (status, ms to the kernel's receive time of its first bytes, ms to when
    this loop read them, Retry-After given, that kernel time in time_ns). The first
    figure leaves out this client's own lag (one Python loop reading hundreds of
    answers); both are from the send."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setblocking(False)
        socks.append(sock)
    selector = selectors.DefaultSelector()
    pending: dict[int, list] = {}  # index: [sent ns, bytes so far, kernel ns, read ns]
    due: list[tuple[float, int]] = []  # (monotonic time, index) of the next sends
    answers = []
    end = time.monotonic() + seconds

    def send(i: int) -> None:
        pending[i] = [time.time_ns(), b"", None, None]
        socks[i].send(request)

    for i, sock in enumerate(socks):
        selector.register(sock, selectors.EVENT_READ, i)
    time.sleep(settle)
    for i in range(n):
        send(i)
    give_up = end + 120
    while (pending or due) and time.monotonic() < give_up:
        now = time.monotonic()
        while due and due[0][0] <= now:
            send(heapq.heappop(due)[1])
        wait = min(0.05, max(0.0, due[0][0] - now)) if due else 0.05
        for key, _ in selector.select(wait):
            i = key.data
            data, ancdata, _, _ = socks[i].recvmsg(1 << 16, 64)
            state = pending.get(i)
            if state is None:
                continue
            if not data:  # closed by the server
                answers.append((0, 0.0, 0.0, False, None))
                del pending[i]
                continue
            if state[2] is None:
                state[3] = time.time_ns()
                state[2] = state[3]
                for level, kind, value in ancdata:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                        sec, nsec = struct.unpack("qq", value[:16])
                        state[2] = sec * 10**9 + nsec
            state[1] += data
            head, sep, body = state[1].partition(b"\r\n\r\n")
            if not sep:
                continue
            status, headers = head_of(head + sep)
            if len(body) < int(headers.get("content-length", 0)):
                continue
            sent, _, kernel, read = state
            has_retry = "retry-after" in headers
            answers.append((status, (kernel - sent) / 1e6, (read - sent) / 1e6, has_retry, kernel))
            del pending[i]
            if retry == "once" or time.monotonic() >= end:
                continue
            pause = float(headers["retry-after"]) if retry == "retry-after" and has_retry else 0
            heapq.heappush(due, (time.monotonic() + pause, i))
    for sock in socks:
        sock.close()
    return answers


async def burst_grpc(target: str, n: int, model: str) -> list[tuple[int, float, bool]]:
    import grpc

    from bitserve.api.proto import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    for name, value in (
        ("text_input", b"Who is my shepherd?"),
        ("sampling_parameters", json.dumps({"max_tokens": 200, "ignore_eos": True}).encode()),
    ):
        tensor = request.inputs.add(name=name, datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(value)
    data = request.SerializeToString()
    async with grpc.aio.insecure_channel(target) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=None,
            response_deserializer=None,
        )
        await channel.channel_ready()

        async def one() -> tuple:
            t0 = time.perf_counter()
            call = infer(data, timeout=60)
            try:
                await call
                code = 200
            except grpc.aio.AioRpcError as e:
                code = {"RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503}.get(e.code().name, 500)
            ms = (time.perf_counter() - t0) * 1e3
            trailing = await call.trailing_metadata() or ()
            return code, ms, any(k == "retry-after" for k, _ in trailing)

        return await asyncio.gather(*(one() for _ in range(n)))


async def poll_live(port: int, stop: asyncio.Event) -> list[int]:
    codes = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    while not stop.is_set():
        writer.write(request)
        status, headers = head_of(await reader.readuntil(b"\r\n\r\n"))
        await reader.readexactly(int(headers.get("content-length", 0)))
        codes.append(status)
        await asyncio.sleep(0.05)
    writer.close()
    return codes


def loop_cpu(pid: int) -> float:
    """Seconds of CPU the server's main thread (its event loop) has used (schedstat's
    nanoseconds: stat's clock ticks are 10 ms, a burst's whole cost is 30-50)."""
    return loop_sched(pid)[0] / 1e9


def loop_sched(pid: int) -> tuple[int, int]:
    """The event loop thread's ns on a CPU and ns waiting for one (runnable)."""
    on_cpu, waiting = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:2]
    return int(on_cpu), int(waiting)


def sample_loop(pid: int, stop: threading.Event) -> list[tuple[int, int, int]]:
    """(time_ns, loop ns on CPU, loop ns waiting for a CPU) every ~0.5 ms until `stop`:
    what the loop did before a burst's last refusal, in its own CPU time, which the
    box's load does not stretch as it stretches wall-clock time."""
    samples = []
    while not stop.is_set():
        samples.append((time.time_ns(), *loop_sched(pid)))
        time.sleep(0.0005)
    return samples


def before(samples: list[tuple[int, int, int]], when: int) -> tuple[int, int, int]:
    """The last sample taken at or before `when` (time_ns)."""
    earlier = [s for s in samples if s[0] <= when]
    return earlier[-1] if earlier else samples[0]


async def measure(
    port: int, grpc_target: str, args: argparse.Namespace, model: str, pid: int
) -> dict:
    """One round of each protocol: `args.burst` clients that act as `args.retry` says."""
    # 16 tokens: the requests admitted are done soon (the streams keep the engine busy)
    chat = http_request("/v1/chat/completions", chat_body(16, False, model))
    v2 = http_request(f"/v2/models/{model}/infer", v2_body(16))
    n, retry, seconds = args.burst, args.retry, args.retry_seconds
    protocols = {
        "openai-http": lambda: asyncio.to_thread(timed_clients, port, chat, n, retry, seconds),
        "v2-http": lambda: asyncio.to_thread(timed_clients, port, v2, n, retry, seconds),
    }
    if args.grpc:
        protocols["v2-grpc"] = lambda: burst_grpc(grpc_target, n, model)
    stop = asyncio.Event()
    live = asyncio.create_task(poll_live(port, stop))
    rows = {}
    for name, run in protocols.items():
        cpu = loop_cpu(pid)
        stop_sampling = threading.Event()
        sampling = asyncio.create_task(asyncio.to_thread(sample_loop, pid, stop_sampling))
        await asyncio.sleep(0.01)
        start = time.time_ns()
        answers = [a if len(a) == 5 else (a[0], a[1], a[1], a[2], None) for a in await run()]
        cpu = loop_cpu(pid) - cpu
        stop_sampling.set()
        samples = await sampling
        await asyncio.sleep(0.5)
        refused = [a for a in answers if a[0] in (429, 503) and a[3]]
        wire, read = [a[1] for a in refused], [a[2] for a in refused]
        last = max((a[4] for a in refused if a[4] is not None), default=None)
        first, at_last = before(samples, start), before(samples, last or start)
        rows[name] = {
            "requests": len(answers),
            "refused": len(refused),
            "statuses": {str(s): sum(a[0] == s for a in answers) for s in {a[0] for a in answers}},
            "p50_ms": float(np.percentile(wire, 50)) if wire else None,
            "p99_ms": float(np.percentile(wire, 99)) if wire else None,
            "p99_read_ms": float(np.percentile(read, 99)) if read else None,
            "loop_cpu_us_per_request": cpu / max(1, len(answers)) * 1e6,
            # from the burst's first send to its last refusal (HTTP): the event loop's
            # CPU, and its time runnable but waiting for a CPU (the box's share)
            "loop_cpu_ms_to_last": (at_last[1] - first[1]) / 1e6 if last else None,
            "loop_runq_ms_to_last": (at_last[2] - first[2]) / 1e6 if last else None,
        }
    stop.set()
    codes = await live
    return {"protocols": rows, "live_probes": len(codes), "live_all_200": set(codes) == {200}}


# -- slow and hostile clients (item 4) ----------------------------------------------
def streams(port: int, count: int, read: bool, seconds: float) -> None:
    """`count` streamed chats of 200 tokens with 20 logprobs a token (~300 KB each),
    read or never read; each opens again once it ends or the server cuts it."""
    body = CHAT | {"max_tokens": 200, "ignore_eos": True, "stream": True}
    body |= {"logprobs": True, "top_logprobs": 20}
    request = http_request("/v1/chat/completions", json.dumps(body), close=True)

    async def one() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
                reader, writer = await asyncio.open_connection(sock=sock)
                writer.write(request)
                if read:
                    await asyncio.wait_for(reader.read(-1), end - time.monotonic())
                else:  # held, never read, to the end (or until the server cuts it)
                    await asyncio.sleep(max(0.0, end - time.monotonic()))
                writer.close()
            except (OSError, TimeoutError):
                await asyncio.sleep(0.5)

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(count)))

    asyncio.run(main())


def slowloris(port: int, count: int, seconds: float) -> None:
    """`count` connections sending a request a byte a second (half the headers, half
    the body), each opened again when the server closes it."""
    body = json.dumps(CHAT | {"max_tokens": 16}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"

    async def one(i: int) -> None:
        end = time.monotonic() + seconds
        if i % 2:  # the headers a byte a second
            fast, slow = b"", head.encode() + b"X-Pad: " + b"a" * 100
        else:  # the headers at once, the body a byte a second
            fast, slow = head.encode() + b"\r\n", body
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(fast)
                for byte in slow:
                    writer.write(bytes([byte]))
                    try:
                        await asyncio.wait_for(reader.read(4096), 1.0)
                        break  # answered (408) or closed: the server is done with it
                    except TimeoutError:
                        pass
                writer.close()
            except OSError:
                await asyncio.sleep(1.0)

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(count)))

    asyncio.run(main())


async def normal_chats(port: int, seconds: float, users: int = 4) -> list[float]:
    request = http_request("/v1/chat/completions", chat_body(16, False))
    times: list[float] = []

    async def user() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            writer.write(request)
            status, headers = head_of(await reader.readuntil(b"\r\n\r\n"))
            await reader.readexactly(int(headers["content-length"]))
            if status == 200:
                times.append((time.perf_counter() - t0) * 1e3)
        writer.close()

    await asyncio.gather(*(user() for _ in range(users)))
    return times


def engine_idle(port: int, limit: float) -> float:
    """Wait until the server's LLM engine runs no request (seconds waited, at most
    `limit`): the tokens of requests whose clients do not read are computed anyway."""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < limit:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        running = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("bitserve_llm_num_requests_running")
        )
        if running == 0:
            break
        time.sleep(0.5)
    return time.monotonic() - start


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that runs `tree`'s server code: on PYTHONPATH, and the working
    directory not first on sys.path (`python -m` puts it there, ahead of PYTHONPATH: run
    from a checkout, every --tree served that checkout's code)."""
    return {"PYTHONPATH": str(tree.resolve()), "PYTHONSAFEPATH": "1"}


def run_hostile(tree: Path, repo: Path, args: argparse.Namespace) -> dict:
    """`args.rounds` rounds of a clean phase and a hostile one on one server, their
    order swapped every round; the ratio of the p99s per round."""
    port = free_port()
    env = tree_env(tree)
    ctx = multiprocessing.get_context("spawn")
    rounds = []
    with Server("bitserve", bitserve_command(repo, port), port, env=env):
        for r in range(args.rounds):
            rows = {}
            phases = [("clean", False), ("hostile", True)]
            for name, hostile in phases if r % 2 == 0 else phases[::-1]:
                seconds = args.seconds + 150  # terminated when the timing ends
                kids = []
                if hostile:
                    kids.append(ctx.Process(target=streams, args=(port, 100, False, seconds)))
                    kids.append(ctx.Process(target=slowloris, args=(port, 1000, seconds)))
                for kid in kids:
                    kid.start()
                time.sleep(2.0)
                if hostile:  # past the never-read streams' tokens: what is timed is the
                    idle_after = engine_idle(port, 120.0)  # sockets' cost, not their compute
                try:
                    times = asyncio.run(normal_chats(port, args.seconds))
                finally:
                    for kid in kids:
                        kid.terminate()
                        kid.join(10)
                rows[name] = {
                    "idle_after_s": idle_after if hostile else None,
                    "chats": len(times),
                    "p50_ms": float(np.percentile(times, 50)) if times else None,
                    "p99_ms": float(np.percentile(times, 99)) if times else None,
                }
                time.sleep(12.0)  # the server has closed what the hostile clients left
            ratio = None
            if rows["clean"]["p99_ms"] and rows["hostile"]["p99_ms"]:
                ratio = rows["hostile"]["p99_ms"] / rows["clean"]["p99_ms"]
            rounds.append({"first": "clean" if r % 2 == 0 else "hostile", **rows, "ratio": ratio})
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    return {"tree": str(tree), "rounds": rounds, "p99_ratios": ratios}


def run_probe(trees: list[Path], repo: Path, args: argparse.Namespace) -> list[dict]:
    """--probe: the soak's overload probe, `args.probe` times on one server per tree (all
    up at once, the trees' bursts interleaved, their order rotated every round): `--burst`
    chats at once on tinylm with the engine idle before each (it admits 64 and refuses
    the rest), on connections opened just before (the burst meets their accepts) or
    0.5 s before (accepted already), alternately; p99 of the 429s per burst, and the
    event loop's CPU per client of the burst (schedstat of its thread, sampled: from
    before the connections are opened to the last 429). Then, on `full` (every request
    refused), the event loop's CPU per connection: accept, request and refusal, close
    (400 connections at a time)."""
    chat = http_request("/v1/chat/completions", chat_body(64, False))
    full = http_request("/v1/chat/completions", chat_body(64, False, "full"))
    results = [
        {
            "tree": str(t),
            "p99_ms": {"fresh": [], "accepted": []},
            "loop_us_to_last_429": {"fresh": [], "accepted": []},
            "loop_us_per_connection": [],
        }
        for t in trees
    ]
    with contextlib.ExitStack() as stack:
        servers = []
        for tree in trees:
            port = free_port()
            env = tree_env(tree)
            server = stack.enter_context(
                Server("bitserve", bitserve_command(repo, port), port, env=env)
            )
            timed_clients(port, chat, 8)
            servers.append((port, server.proc.pid))
        order = list(range(len(trees)))
        for b in range(2 * args.probe):
            kind = ("fresh", "accepted")[b % 2]
            for i in order[b % len(order) :] + order[: b % len(order)]:
                port, pid = servers[i]
                time.sleep(6.0 / len(trees))  # the last burst's 64 admitted are done
                stop = threading.Event()
                with ThreadPoolExecutor(1) as pool:
                    sampling = pool.submit(sample_loop, pid, stop)
                    time.sleep(0.01)
                    start = time.time_ns()
                    settle = 0.5 * (kind == "accepted")
                    answers = timed_clients(port, chat, args.burst, settle=settle)
                    stop.set()
                    samples = sampling.result()
                refused = [a for a in answers if a[0] == 429 and a[3]]
                p99 = float(np.percentile([a[1] for a in refused], 99)) if refused else None
                results[i]["p99_ms"][kind].append(p99)
                last = max((a[4] for a in refused if a[4] is not None), default=None)
                if last is not None:  # the loop's CPU from the connections to the last 429
                    cpu = before(samples, last)[1] - before(samples, start)[1]
                    results[i]["loop_us_to_last_429"][kind].append(cpu / args.burst / 1e3)
        for r in range(args.probe):
            for i in order[r % len(order) :] + order[: r % len(order)]:
                port, pid = servers[i]
                time.sleep(1.0)
                cpu = [loop_sched(pid)[0]]
                socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(400)]
                time.sleep(0.5)
                cpu.append(loop_sched(pid)[0])
                for sock in socks:
                    sock.sendall(full)
                for sock in socks:
                    sock.recv(65536)
                time.sleep(0.3)
                cpu.append(loop_sched(pid)[0])
                for sock in socks:
                    sock.close()
                time.sleep(0.5)
                cpu.append(loop_sched(pid)[0])
                results[i]["loop_us_per_connection"].append(
                    [(b - a) / 400 / 1e3 for a, b in itertools.pairwise(cpu)]
                )
    return results


def run_tree(tree: Path, repo: Path, args: argparse.Namespace, env: dict) -> dict:
    """One server of `tree`'s code (with `env`): a round of refusals alone (--alone),
    then one under saturation."""
    grpc_port = free_port()
    port = free_port()
    cmd = bitserve_command(repo, port, "--grpc-port", str(grpc_port))
    env = tree_env(tree) | env
    with Server("bitserve", cmd, port, env=env) as server:
        target, pid = f"127.0.0.1:{grpc_port}", server.proc.pid
        idle = None
        if args.alone:  # refusals alone: `full` has no place in its queue, the engine idle
            idle = asyncio.run(measure(port, target, args, "full", pid))
        seconds = 30 + 3 * args.retry_seconds
        ctx = multiprocessing.get_context("spawn")
        chunks = ctx.Value("q", 0, lock=False)  # one writer: the saturator
        saturating = (port, args.streams, seconds, not args.unstreamed, chunks)
        saturator = ctx.Process(target=saturate, args=saturating)
        saturator.start()
        time.sleep(3.0)  # the streams are running and the queue is full
        counted, since = chunks.value, time.monotonic()
        try:
            model = "full" if args.refusals_only else "tinylm"
            result = asyncio.run(measure(port, target, args, model, pid))
        finally:
            result_chunks = (chunks.value - counted) / (time.monotonic() - since)
            saturator.terminate()
            saturator.join(10)
        result["stream_chunks_per_s"] = result_chunks
    result["refusals_alone"] = idle["protocols"] if idle else {}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=400, help="clients at once")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, variants interleaved")
    parser.add_argument("--streams", type=int, default=96, help="saturating streamed chats")
    parser.add_argument("--tree", type=Path, action="append", help="server code (default .)")
    parser.add_argument(
        "--server-env",
        action="append",
        help="a variant: KEY=VALUE[,KEY=VALUE...] in the server's environment",
    )
    parser.add_argument(
        "--retry",
        choices=["once", "hammer", "retry-after"],
        default="once",
        help="what a refused client does: nothing (a burst), send again at once, or after "
        "its Retry-After (the openai SDK)",
    )
    parser.add_argument("--retry-seconds", type=float, default=10.0, help="how long they retry")
    parser.add_argument("--alone", action="store_true", help="also refusals with an idle engine")
    parser.add_argument(
        "--unstreamed",
        action="store_true",
        help="the saturating chats are not streamed (what the streams' sends cost refusals)",
    )
    parser.add_argument(
        "--isolation",
        action="append",
        choices=["thread", "process"],
        help="a variant: the tinylm copies' [instance_group] isolation (process: the engine "
        "in a child process, repository/llmprocess.py); default: the config's own",
    )
    parser.add_argument(
        "--refusals-only",
        action="store_true",
        help="the saturated bursts go to `full` (every request refused, none admitted): "
        "what the saturated engine alone costs the refusals",
    )
    parser.add_argument("--grpc", action="store_true", help="also v2 gRPC (a burst)")
    parser.add_argument("--hostile", action="store_true", help="slow and hostile clients")
    parser.add_argument(
        "--probe",
        type=int,
        default=0,
        help="the soak's overload probe this many times (and as many on connections "
        "accepted already), then the loop's CPU per connection",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="--hostile: per phase")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bitserve-overload-"))
    repos = {}
    for isolation in args.isolation or [""]:
        repos[isolation] = repo = work / (isolation or "default") / "models"
        group = f'\n[instance_group]\nisolation = "{isolation}"\n' if isolation else ""
        shutil.copytree(ROOT / "models" / "tinylm", repo / "tinylm")
        config = (ROOT / "models" / "tinylm" / "config.toml").read_text()
        (repo / "tinylm" / "config.toml").write_text(config + group)
        if not args.hostile:  # a twin that refuses everything (no place in its queue)
            shutil.copytree(ROOT / "models" / "tinylm" / "1", repo / "full" / "1")
            config = config.replace("max_queued_requests = 64", "max_queued_requests = 0")
            config = config.replace("268435456", "16777216")
            (repo / "full" / "config.toml").write_text(config + group)
    load_before = os.getloadavg()
    if args.probe:
        results = [x for r in repos.values() for x in run_probe(args.tree or [ROOT], r, args)]
        shutil.rmtree(work, ignore_errors=True)
        print(f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
        for r in results:
            for kind, values in r["p99_ms"].items():
                print(
                    f"{r['tree'][-30:]:30s} {args.burst} chats at once, connections {kind:8s}:"
                    f" 429 p99 {_spread(values)} ms over {len(values)} bursts, loop CPU per"
                    f" client to the last 429 {_spread(r['loop_us_to_last_429'][kind])} us"
                )
            accept, refuse, close = (
                _spread(c) for c in zip(*r["loop_us_per_connection"], strict=True)
            )
            print(
                f"{r['tree'][-30:]:30s} event loop CPU per connection, us (median (min-max) of "
                f"{args.probe}): accept {accept}, request + 429 {refuse}, close {close}"
            )
        print(json.dumps({"bench": "overload-probe", "results": results}))
        return 0
    if args.hostile:
        results = [
            run_hostile(tree, r, args) for tree in args.tree or [ROOT] for r in repos.values()
        ]
        shutil.rmtree(work, ignore_errors=True)
        print(f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
        for r in results:
            for row in r["rounds"]:
                print(
                    f"{r['tree'][-30:]:30s} {row['first']:7s} first: clean p99 "
                    f"{_ms(row['clean']['p99_ms'])} hostile p99 {_ms(row['hostile']['p99_ms'])}"
                    f" ms, ratio {row['ratio']:.2f}"
                )
            ratios = r["p99_ratios"]
            print(
                f"{r['tree'][-30:]:30s} p99 hostile/clean: median {np.median(ratios):.2f}, "
                f"min-max {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} rounds"
            )
        print(json.dumps({"bench": "overload-hostile", "results": results}))
        return 0
    variants = [
        (tree, env, isolation)
        for tree in args.tree or [ROOT]
        for env in args.server_env or [""]
        for isolation in repos
    ]
    runs: dict[int, list[dict]] = {i: [] for i in range(len(variants))}
    for r in range(args.rounds):  # interleaved, the order rotated every round
        for i in [(r + k) % len(variants) for k in range(len(variants))]:
            tree, env, isolation = variants[i]
            env_vars = dict(kv.split("=", 1) for kv in env.split(",") if kv)
            runs[i].append(run_tree(tree, repos[isolation], args, env_vars))
    shutil.rmtree(work, ignore_errors=True)
    load = f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}"
    print(f"{load}; clients: {args.burst}, {args.retry}")
    print(
        f"{'variant':34s} {'phase':9s} {'protocol':12s} {'refused':>9s}  p50 ms (min-max)"
        f"       p99 ms (min-max)     p99 read ms  loop us/req  to the last refusal: loop"
        f" CPU ms, loop waiting for a CPU ms"
    )
    results = []
    for i, (tree, env, isolation) in enumerate(variants):
        label = f"{str(tree)[-20:]} {env} {isolation}"[-34:]
        for phase, key in (("saturated", "protocols"), ("alone", "refusals_alone")):
            for name in runs[i][0][key]:
                rows = [run[key][name] for run in runs[i]]
                refused = f"{sum(x['refused'] for x in rows)}/{sum(x['requests'] for x in rows)}"
                cols = [_spread([x[k] for x in rows]) for k in ("p50_ms", "p99_ms", "p99_read_ms")]
                cpu = np.median([x["loop_cpu_us_per_request"] for x in rows])
                to_last = [
                    _spread([x.get(k) for x in rows])
                    for k in ("loop_cpu_ms_to_last", "loop_runq_ms_to_last")
                ]
                print(
                    f"{label:34s} {phase:9s} {name:12s} {refused:>9s} {cols[0]:>22s} "
                    f"{cols[1]:>22s} {cols[2]:>16s} {cpu:8.0f}  {to_last[0]:>20s} {to_last[1]:>20s}"
                )
        rates = [run.get("stream_chunks_per_s") for run in runs[i]]
        print(f"{label:34s} saturating streams' chunks/s (about tokens/s): {_spread(rates)}")
        live = all(run["live_all_200"] for run in runs[i])
        probes = sum(run["live_probes"] for run in runs[i])
        print(f"{label:34s} live: {probes} probes, all 200: {live}")
        results.append({"tree": str(tree), "env": env, "isolation": isolation, "rounds": runs[i]})
    print(json.dumps({"bench": "overload", "retry": args.retry, "results": results}))
    return 0


def _spread(values: list) -> str:
    """median (min-max) of the rounds' figures."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{np.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def _ms(value: float | None) -> str:
    return f"{value:8.1f}" if value is not None else "     n/a"


if __name__ == "__main__":
    raise SystemExit(main())
