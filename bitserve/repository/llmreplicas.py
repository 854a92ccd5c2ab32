"""LLM data-parallel replicas on Ray: `isolation = "ray"` with `count = N` on an llm model.

Each replica is a whole engine (an `LLMService`, with its own TP/PP workers if the
parameters ask for them) in a Ray actor placed on any node of the cluster (spread over
nodes when it can be). The server keeps the front door: the tokenizer, the chat
template, the length and vocabulary checks and one admission queue for all replicas
(`RayLLMService` is an `LLMService` whose engine is elsewhere), so every protocol
(OpenAI, v2 generate, gRPC streams, batch jobs) reaches the replicas through the same
`process` / `generate` it uses for one engine. A request is sent with one actor call
(`submit`); its outputs come back on the replica's one output stream (`outputs`, a
Ray streaming call the router reads for the replica's whole life), which carries one
message per engine step with every request's new tokens and text (detokenised on the
replica), not one message per token per request: Ray's per-item cost, and the whole
token list each output carried, were most of the router's CPU per token. The router
rebuilds each request's cumulative output. A request whose stream is closed (a client
gone, a cancelled task) is aborted on its replica (`abort`), which frees its KV blocks.
The router speaks to a replica through a transport with these calls (`RayHandle`, an
actor); `llmprocess.py` runs the same service over engine processes on this machine
(`isolation = "process"`, `LocalHandle`: a pipe), without Ray.

Routing (`PrefixRouter`): the server keeps an approximate map of which prompt prefixes
each replica holds, as the engine's prefix cache keys them (the chained block hashes of
`llm/block_manager.py`), and sends a request to the replica holding its longest cached
prefix, unless that replica has more than `route_imbalance` requests in flight above
the least-loaded one: then the least-loaded takes it (SGLang's cache-aware router and
Ray Serve's PrefixCacheAffinityRouter decide the same way). A prompt with no cached
prefix anywhere goes to the least-loaded replica. Each decision is counted by rule.

A replica whose actor dies (its node lost, its process killed) is noticed by the
streams it held and by a ping every second: its streams end with EngineDead (503,
Retry-After), new requests go to the others, and a replacement is started, which waits
for Ray to find room for it. The model stays ready while one replica is healthy.

    backend = "llm"
    [instance_group]
    isolation = "ray"
    count = 2
    num_cpus = 1
    [parameters]
    route_imbalance = 8    # in-flight requests above the least-loaded before affinity yields
    route_sessions = true  # sticky sessions: a request's `x-session-id` header, else its
                           # OpenAI `user` field, keeps it on its session's replica
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bitserve import raycluster
from bitserve.backends.base import LoadError
from bitserve.backends.llm import EngineRequest, LLMService
from bitserve.config import ModelConfig
from bitserve.llm.async_engine import EngineDead
from bitserve.llm.block_manager import NO_PARENT, chain_hash
from bitserve.llm.engine import load_tokenizer
from bitserve.llm.outputs import CompletionOutput, RequestOutput
from bitserve.llm.sampling_params import SamplingParams
from bitserve.llm.scheduler import RequestTooLong
from bitserve.repository.scaling import ScalingRule

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("bitserve.repository")

PING_PERIOD_S = 1.0
START_TIMEOUT_S = 300.0
ROUTER_KEYS = {"route_imbalance", "route_policy", "route_sessions"}
MAX_SESSIONS = 100_000  # sticky keys remembered (least recently used forgotten)
RULES = ("prefix", "least_loaded", "overloaded", "sticky", "round_robin")
LOST = object()  # put in a request's queue when its replica is lost


class ReplicaLost(Exception):
    """The replica holding a request died (or stopped answering)."""


# ---------------------------------------------------------------- the replica (actor)


class LLMReplicaActor:
    """One replica: an `LLMService` on its node; its admission is the router's."""

    def __init__(self, config_doc: dict, version_dir: str, threads: int):
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        params = {k: v for k, v in config_doc.get("parameters", {}).items() if k not in ROUTER_KEYS}
        config_doc = {**config_doc, "parameters": params, "instance_group": {}}
        self.service = LLMService(ModelConfig.model_validate(config_doc), Path(version_dir))

    async def start(self) -> dict:
        self.tasks: dict[int, asyncio.Task] = {}
        self.aborted: set[int] = set()
        self.highest = -1
        self.outbox: list[tuple[int, RequestOutput | Exception]] = []
        self.wake = asyncio.Event()
        self.metrics: dict = {}
        self._reading: asyncio.Task | None = None
        await self.service.start()
        engine = self.service.engine.engine
        ray = sys.modules.get("ray")  # a local engine process (llmprocess.py) has no Ray
        on_ray = ray is not None and ray.is_initialized()
        return {
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id() if on_ray else "local",
            "warmup_seconds": self.service.warmup_seconds,
            "num_blocks": engine.scheduler.block_manager.num_blocks,
            "max_model_len": int(engine.config.max_model_len),
        }

    async def submit(
        self, key: int, ids: list[int], params: SamplingParams, request_id, priority, stream
    ) -> None:
        """Start one request; its outputs go out through `outputs`, tagged with `key`."""
        self.highest = max(self.highest, key)
        if key in self.aborted:
            self.aborted.discard(key)
            return
        request = self.service._reserve(ids, params)
        task = asyncio.create_task(self._run(key, request, request_id, priority, stream))
        self.tasks[key] = task

    async def _run(self, key: int, request, request_id, priority, stream) -> None:
        tokens = logprobs = 0  # how many of each the router already has
        first = True
        try:
            generation = self.service.generate(request, request_id, priority, stream)
            async with contextlib.aclosing(generation):
                async for out in generation:
                    c = out.outputs[0]
                    new = CompletionOutput(
                        0,
                        c.text if out.finished else "",  # else the router adds up the deltas
                        c.token_ids[tokens:],
                        None if c.logprobs is None else c.logprobs[logprobs:],
                        c.finish_reason,
                        c.stop_reason,
                        c.delta_text,
                    )
                    tokens = len(c.token_ids)
                    logprobs = len(c.logprobs or ())
                    self._post(
                        key,
                        RequestOutput(
                            out.request_id,
                            out.prompt if first else None,
                            [],  # the router has the prompt
                            [new],
                            out.finished,
                            out.prompt_logprobs if first else None,
                            out.num_cached_tokens,
                            out.metrics,
                            out.error,
                        ),
                    )
                    first = False
        except asyncio.CancelledError:
            pass  # aborted by the router: the generation closed, the engine freed it
        except Exception as e:  # this request's own failure, raised again on the router
            self._post(key, _portable(e))
        finally:
            self.tasks.pop(key, None)

    def _post(self, key: int, item: RequestOutput | Exception) -> None:
        self.outbox.append((key, item))
        self.wake.set()

    async def outputs(self):
        """The one stream to the router: each message carries every output made since
        the last (one engine step's, for all its requests), not one message per token
        per request."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.outbox = self.outbox, []
            yield batch

    async def abort(self, key: int) -> None:
        """The router's client left: stop the request (a key not yet submitted is
        remembered, so a late `submit` does not start it)."""
        task = self.tasks.get(key)
        if task is not None:
            task.cancel()
        elif key > self.highest:  # keys rise: one at or below it has finished already
            self.aborted.add(key)

    async def health(self) -> tuple[str | None, dict]:
        """Why it is unhealthy (None when it is not; a stalled engine loop says so), and
        its engine's metrics as last read. It answers at once: the metrics wait for the
        engine's lock, which a step holds (a long prefill on a loaded box took more than
        the router's 10 s ping limit), so they are read off the event loop, one read at
        a time, and the next ping gets them."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read_metrics())
        return self.service.healthy(), self.metrics

    async def _read_metrics(self) -> None:
        self.metrics = (await asyncio.to_thread(self.service.engine.metrics)).as_dict()

    async def stop(self) -> None:
        await self.service.stop()


# ---------------------------------------------------------------- routing


class PrefixRouter:
    """Which replica a prompt goes to. `holds[r]` is the approximate set of block
    hashes replica r has cached, in LRU order and bounded by its KV pool; `load[r]`
    its requests in flight. `policy = "round_robin"` is the baseline it is measured
    against."""

    def __init__(self, block_size: int, imbalance: int = 8, policy: str = "prefix"):
        if policy not in ("prefix", "round_robin"):
            raise LoadError(f"route_policy must be 'prefix' or 'round_robin', got {policy!r}")
        self.block_size, self.imbalance, self.policy = block_size, imbalance, policy
        self.holds: dict[Any, OrderedDict[int, None]] = {}
        self.capacity: dict[Any, int] = {}
        self.load: dict[Any, int] = {}
        self.routed: dict[Any, int] = {}  # requests sent, the tie-break between equal loads
        self.decisions = dict.fromkeys(RULES, 0)
        self.sticky: OrderedDict[str, Any] = OrderedDict()  # session key -> replica, LRU
        self._next = 0

    def add(self, replica: Any, num_blocks: int) -> None:
        self.holds[replica], self.capacity[replica] = OrderedDict(), num_blocks
        self.load[replica], self.routed[replica] = 0, 0

    def remove(self, replica: Any) -> None:
        for table in (self.holds, self.capacity, self.load, self.routed):
            table.pop(replica, None)
        for key in [k for k, r in self.sticky.items() if r is replica]:
            del self.sticky[key]

    def hashes(self, ids: list[int]) -> list[int]:
        """The chained hashes of the prompt's full blocks, as the block manager makes
        them (the rope key left out: equal for every model without long-rope switches).
        The last prompt token is always recomputed, so it never counts as cached."""
        out, parent, bs = [], NO_PARENT, self.block_size
        for start in range(0, len(ids) - 1 - bs + 1, bs):
            parent = chain_hash(parent, tuple(ids[start : start + bs]))
            out.append(parent)
        return out

    def pick(self, ids: list[int], candidates: list[Any], key: str | None = None) -> Any:
        """The replica for this prompt (one of `candidates`, the healthy ones); it
        records the prompt's blocks as held there. A session `key` sticks to the replica
        its first request went to while that one is healthy and not overloaded."""
        if key is not None:
            replica = self.sticky.get(key)
            least = self.least_loaded(candidates)
            if replica in candidates and self.load[replica] - self.load[least] <= self.imbalance:
                self.sticky.move_to_end(key)
                return self._take(replica, self.hashes(ids), "sticky")
            replica = self.pick(ids, candidates)
            self.sticky[key] = replica
            while len(self.sticky) > MAX_SESSIONS:
                self.sticky.popitem(last=False)
            return replica
        if self.policy == "round_robin":
            self._next += 1
            return self._take(candidates[self._next % len(candidates)], [], "round_robin")
        hashes = self.hashes(ids)
        least = self.least_loaded(candidates)
        best, matched = least, 0
        for replica in candidates:
            held = self.holds[replica]
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n > matched or (n == matched and n and self.load[replica] < self.load[best]):
                best, matched = replica, n
        if matched == 0:
            return self._take(least, hashes, "least_loaded")
        if self.load[best] - self.load[least] > self.imbalance:
            return self._take(least, hashes, "overloaded")
        return self._take(best, hashes, "prefix")

    def least_loaded(self, candidates: list[Any]) -> Any:
        return min(candidates, key=lambda r: (self.load[r], self.routed[r]))

    def _take(self, replica: Any, hashes: list[int], rule: str) -> Any:
        self.decisions[rule] += 1
        self.routed[replica] += 1
        held = self.holds[replica]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity[replica]:
            held.popitem(last=False)
        return replica


# ---------------------------------------------------------------- the router's service


class RayHandle:
    """The transport to one replica actor on Ray; `llmprocess.LocalHandle` is the same
    to a local engine process. A lost replica raises `ReplicaLost` (or any error from
    `outputs`); a request's own error comes back as itself."""

    def __init__(self, config: ModelConfig, version_dir: Path, slot: int):
        import ray

        self.resources = config.instance_group.ray_resources()
        threads = config.instance_group.threads or max(1, int(self.resources["num_cpus"]))
        self.actor = (
            ray.remote(LLMReplicaActor)
            .options(
                **self.resources,
                max_restarts=0,  # the watchdog replaces a dead replica with a fresh actor
                scheduling_strategy="SPREAD",
                name=f"bitserve-llm:{config.name}:{slot}:{os.getpid()}:{time.monotonic_ns()}",
            )
            .remote(config.model_dump(mode="json"), str(version_dir), threads)
        )

    async def start(self) -> dict:
        return await self.actor.start.remote()

    async def submit(self, *args: Any) -> None:
        import ray

        try:
            await self.actor.submit.remote(*args)
        except ray.exceptions.RayActorError as e:
            raise ReplicaLost(str(e)) from e
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            raise cause if isinstance(cause, BaseException) else RuntimeError(str(e)) from None

    async def outputs(self):
        async for ref in self.actor.outputs.options(num_returns="streaming").remote():
            yield await ref

    def abort(self, key: int) -> None:
        self.actor.abort.remote(key)

    async def health(self) -> tuple[str | None, dict]:
        return await self.actor.health.remote()

    async def stop(self) -> None:
        await self.actor.stop.remote()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def describe(self) -> str:
        return f"resources {self.resources}"


class Replica:
    """The server's handle on one replica (`actor`: its transport, a `RayHandle` or an
    `llmprocess.LocalHandle`)."""

    def __init__(self, actor: Any, slot: int):
        self.actor, self.slot = actor, slot
        self.pid = 0
        self.node = ""
        self.dead: str | None = None
        self.problem: str | None = None  # the replica's own health answer
        self.metrics: dict = {}
        self.served = 0  # requests routed here
        self.draining = False  # scaled down: takes no new request, removed once idle
        self.streams: dict[int, asyncio.Queue] = {}  # request key -> its outputs
        self.pump: asyncio.Task | None = None  # reads the replica's output stream

    def usable(self) -> bool:
        return self.dead is None and self.problem is None and not self.draining


class RayLLMService(LLMService):
    """An `LLMService` whose engines are Ray actors: same front door, routed generation."""

    def __init__(self, config: ModelConfig, version_dir: Path):
        params = dict(config.parameters)
        router = {k: params.pop(k) for k in list(params) if k in ROUTER_KEYS}
        super().__init__(config.model_copy(update={"parameters": params}), version_dir)
        self.config = config
        imbalance = router.get("route_imbalance", 8)
        if not isinstance(imbalance, int) or isinstance(imbalance, bool) or imbalance < 0:
            raise LoadError(
                f"{version_dir.parent / 'config.toml'}: route_imbalance must be an int >= 0"
            )
        block_size = int(self.engine_args.get("block_size", 16))
        self.router = PrefixRouter(block_size, imbalance, router.get("route_policy", "prefix"))
        self.sessions = router.get("route_sessions", False)
        if not isinstance(self.sessions, bool):
            raise LoadError(
                f"{version_dir.parent / 'config.toml'}: route_sessions must be true or false"
            )
        self.replicas: list[Replica] = []
        self.vocab = 0
        self.replaced = 0  # replicas started again after theirs died
        self._watch: asyncio.Task | None = None
        self._spawning: dict[int, asyncio.Task] = {}  # slot -> its replica starting
        self.scaling = config.instance_group.autoscaling
        self.rule = ScalingRule(self.scaling) if self.scaling is not None else None
        self._drains: set[asyncio.Task] = set()
        self._keys = itertools.count()  # one per request sent to a replica

    # ------------------------------------------------------------ lifecycle

    def _connect(self) -> None:
        raycluster.connect()

    def _handle(self, slot: int) -> Any:
        """A new replica's transport, not started yet."""
        return RayHandle(self.config, self.version_dir, slot)

    async def start(self) -> None:
        self._connect()
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.folder)
        if self.tokenizer is None:
            raise LoadError(f"{self.folder}: no tokenizer.json / tokenizer_config.json")
        self.vocab = int(_hf_config(self.folder).get("vocab_size") or len(self.tokenizer))
        count = self.config.instance_group.count
        if self.scaling is not None:  # count is the initial number, at least one to start
            count = min(max(count, self.scaling.min_replicas, 1), self.scaling.max_replicas)
        started = time.perf_counter()
        self.replicas = list(await asyncio.gather(*(self._spawn(i) for i in range(count))))
        self.warmup_seconds = max(0.0, time.perf_counter() - started)
        self._watch = asyncio.create_task(self._watchdog())

    async def _spawn(self, slot: int) -> Replica:
        actor = self._handle(slot)
        replica = Replica(actor, slot)
        try:
            info = await asyncio.wait_for(actor.start(), START_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(Exception):
                actor.kill()
            raise LoadError(
                f"{self.version_dir}: LLM replica {slot} not placed and warmed in "
                f"{START_TIMEOUT_S:.0f} s ({actor.describe()})"
            ) from None
        except Exception as e:
            with contextlib.suppress(Exception):
                actor.kill()
            raise LoadError(f"{self.version_dir}: LLM replica {slot} failed to start: {e}") from e
        replica.pid, replica.node = info["pid"], info["node"]
        self.max_model_len = info["max_model_len"]
        self.router.add(replica, info["num_blocks"])
        replica.pump = asyncio.create_task(self._pump(replica))
        log.info(
            "model %s LLM replica %d up: pid %d on node %s",
            self.config.name,
            slot,
            replica.pid,
            replica.node[:8],
        )
        return replica

    async def stop(self) -> None:
        for task in [self._watch, *self._spawning.values(), *self._drains]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for replica in self.replicas:
            if replica.pump is not None:
                replica.pump.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(replica.actor.stop(), 10)
            with contextlib.suppress(Exception):
                replica.actor.kill()

    # ------------------------------------------------------------ health

    async def _watchdog(self) -> None:
        """Ping every replica each second (its health and metrics come back), and start
        a replacement for one that died."""
        while True:
            await asyncio.sleep(PING_PERIOD_S)
            await asyncio.gather(*(self._ping(r) for r in self.replicas if r.dead is None))
            for replica in [r for r in self.replicas if r.dead is not None]:
                if replica.slot not in self._spawning:
                    self._spawning[replica.slot] = asyncio.create_task(self._replace(replica))
            if self.scaling is not None:
                self._autoscale()

    # ------------------------------------------------------------ autoscaling

    def _autoscale(self) -> None:
        """Ray Serve's rule (`scaling.ScalingRule`); one replica drained at a time."""
        serving = [r for r in self.replicas if not r.draining]
        have = len(serving) + sum(1 for s in self._spawning if s not in {r.slot for r in serving})
        change = self.rule.change(self.running + self.waiting, have)
        for _ in range(max(change, 0)):
            self._grow()
        alive = [r for r in serving if r.dead is None]
        if change < 0 and alive:  # the least-loaded goes; a dead one is being replaced
            self._drain(min(alive, key=lambda r: self.router.load.get(r, 0)))

    def _grow(self) -> None:
        slot = max([r.slot for r in self.replicas] + list(self._spawning) + [-1]) + 1
        log.info("model %s: scaling up, starting replica %d", self.config.name, slot)

        async def grow() -> None:
            try:
                replica = await self._spawn(slot)
                self.replicas = [*self.replicas, replica]
            except LoadError as e:
                log.error("model %s: scaling up: %s", self.config.name, e)
            finally:
                self._spawning.pop(slot, None)

        self._spawning[slot] = asyncio.create_task(grow())

    def _drain(self, replica: Replica) -> None:
        """Take no new request; once its streams end, stop and remove it."""
        log.info("model %s: scaling down, draining replica %d", self.config.name, replica.slot)
        replica.draining = True

        async def drain() -> None:
            try:
                while self.router.load.get(replica, 0) > 0 and replica.dead is None:
                    await asyncio.sleep(0.1)
                if replica.pump is not None:
                    replica.pump.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(replica.actor.stop(), 10)
            finally:
                with contextlib.suppress(Exception):
                    replica.actor.kill()
                self.router.remove(replica)
                self.replicas = [r for r in self.replicas if r is not replica]
                self._drains.discard(task)

        task = asyncio.create_task(drain())
        self._drains.add(task)

    async def _cold_start(self) -> list[Replica]:
        """Scaled to zero: start a replica and wait for it (--lazy-load semantics)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (candidates := [r for r in self.replicas if r.usable()]):
            if not self._spawning:
                self._grow()
            if time.monotonic() > deadline:
                raise EngineDead(f"model '{self.config.name}': no replica started in time")
            await asyncio.sleep(0.05)
        return candidates

    async def _ping(self, replica: Replica) -> None:
        try:
            replica.problem, replica.metrics = await asyncio.wait_for(
                replica.actor.health(), 10 * PING_PERIOD_S
            )
        except Exception as e:  # dead, or wedged past ten periods
            self._lost(replica, f"ping failed: {type(e).__name__}")

    def _lost(self, replica: Replica, why: str) -> None:
        if replica.dead is None:
            replica.dead = why
            self.router.remove(replica)
            log.error("model %s LLM replica %d lost: %s", self.config.name, replica.slot, why)
        for queue in replica.streams.values():  # no request waits on it any more
            queue.put_nowait(LOST)
        if replica.pump is not None and replica.pump is not asyncio.current_task():
            replica.pump.cancel()

    async def _replace(self, old: Replica) -> None:
        """Start the slot's replacement; it waits for Ray to find room (a node coming
        back, an autoscaler adding one), retrying a failed start."""
        with contextlib.suppress(Exception):
            old.actor.kill()
        try:
            while True:
                try:
                    new = await self._spawn(old.slot)
                    break
                except LoadError as e:
                    log.error("model %s: replacing replica %d: %s", self.config.name, old.slot, e)
                    await asyncio.sleep(PING_PERIOD_S)
            self.replicas = [new if r is old else r for r in self.replicas]
            self.replaced += 1
        finally:
            self._spawning.pop(old.slot, None)

    def down(self) -> str | None:
        if any(r.usable() for r in self.replicas):
            return None
        if self.scaling is not None and not any(r.dead or r.problem for r in self.replicas):
            return None  # scaled to zero (or draining to it): the next request starts one
        why = "; ".join(f"replica {r.slot}: {r.dead or r.problem}" for r in self.replicas)
        return f"no healthy LLM replica ({why})"

    def healthy(self) -> str | None:
        return self.down()

    @property
    def restarting(self) -> str | None:  # the base class sets it; nothing restarts here
        return None

    @restarting.setter
    def restarting(self, value: str | None) -> None:
        pass

    @property
    def guided_max_string(self) -> int | None:
        return self.engine_args.get("guided_max_string", 64)

    def metrics(self) -> dict:
        """The engines' metrics summed over the healthy replicas (the model's figures)."""
        total: dict = {}
        for replica in self.replicas:
            for key, value in replica.metrics.items():
                if isinstance(value, list):
                    old = total.get(key, [])
                    total[key] = [a + b for a, b in zip(old, value, strict=False)] or list(value)
                elif isinstance(value, dict):  # per LoRA adapter: {name: {figure: count}}
                    adapters = total.setdefault(key, {})
                    for name, figures in value.items():
                        mine = adapters.setdefault(name, {})
                        for figure, count in figures.items():
                            mine[figure] = mine.get(figure, 0) + count
                else:
                    total[key] = total.get(key, 0) + value
        if total.get("kv_num_blocks"):
            used = sum(
                r.metrics.get("kv_cache_usage", 0) * r.metrics.get("kv_num_blocks", 0)
                for r in self.replicas
            )
            total["kv_cache_usage"] = used / total["kv_num_blocks"]
            total["kv_block_size"] = self.router.block_size
        return total

    # ------------------------------------------------------------ the front door

    def vocab_size(self) -> int:
        return self.vocab

    def _check_fit(self, ids: list[int], sp: SamplingParams) -> None:
        """The router's share of the engine's checks (the guide compiles on the replica)."""
        if len(ids) + sp.max_tokens > self.max_model_len:
            raise RequestTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the request has {len(ids)} prompt tokens and max_tokens {sp.max_tokens}"
                f" ({len(ids) + sp.max_tokens} in all), which exceeds max_model_len"
            )

    async def generate(
        self,
        request: EngineRequest,
        request_id: str | None = None,
        priority: int = 0,
        stream: bool = True,
    ):
        """Stream one admitted request from the replica the router picks; closing this
        iterator cancels the replica's task (the engine aborts the request). A replica
        lost before the request's first output hands it to another (nothing ran
        there that the client saw); one lost after ends the stream with EngineDead."""
        ids = request.take()
        state = {"started": False}
        try:
            tried: set[int] = set()
            while True:
                candidates = [r for r in self.replicas if r.usable() and id(r) not in tried]
                if not candidates and self.scaling is not None and not tried:
                    candidates = await self._cold_start()
                if not candidates:
                    raise EngineDead(f"model '{self.config.name}': {self.down()}")
                # a session key, where a front door set one (x-session-id, the OpenAI `user`)
                session = getattr(request, "session", None) if self.sessions else None
                replica = self.router.pick(ids, candidates, session)
                tried.add(id(replica))
                outputs = self._stream(replica, ids, request, request_id, priority, stream, state)
                try:
                    async with contextlib.aclosing(outputs):  # a closed stream cancels now
                        async for out in outputs:
                            yield out
                    return
                except ReplicaLost as e:
                    self._lost(replica, "died")
                    if state["started"]:
                        raise EngineDead(
                            f"model '{self.config.name}': LLM replica {replica.slot} "
                            f"(pid {replica.pid}) was lost mid-request"
                        ) from e
                    log.warning(
                        "model %s: replica %d lost before it started a request; another takes it",
                        self.config.name,
                        replica.slot,
                    )
        finally:
            if state["started"]:
                self.running -= 1
            else:
                self._unreserve(len(ids))

    async def _stream(self, replica, ids, request, request_id, priority, stream, state):
        """One request on `replica`: submitted by a call, its outputs read from the
        replica's one output stream (`_pump`) through a queue of its own."""
        key = next(self._keys)
        queue: asyncio.Queue = asyncio.Queue()
        replica.streams[key] = queue
        replica.served += 1
        self.router.load[replica] = self.router.load.get(replica, 0) + 1
        finished = False
        tokens: list[int] = []
        logprobs: list | None = None
        text = ""
        prompt = prompt_logprobs = None
        try:
            await replica.actor.submit(key, ids, request.params, request_id, priority, stream)
            while not finished:
                out = await queue.get()
                if out is LOST:
                    raise ReplicaLost(replica.dead or "lost")
                if isinstance(out, BaseException):
                    raise out
                c = out.outputs[0]
                tokens.extend(c.token_ids)
                c.token_ids = tokens
                if c.logprobs is not None:
                    logprobs = [] if logprobs is None else logprobs
                    logprobs.extend(c.logprobs)
                    c.logprobs = logprobs
                text += c.delta_text
                if not out.finished:
                    c.text = text
                if state["started"]:  # the prompt's parts come with the first output only
                    out.prompt, out.prompt_logprobs = prompt, prompt_logprobs
                prompt, prompt_logprobs = out.prompt, out.prompt_logprobs
                out.prompt_token_ids = ids
                self.last_progress = time.monotonic()
                if not state["started"]:
                    state["started"] = True
                    self._start_running(len(ids))
                finished = out.finished
                yield out
        finally:
            replica.streams.pop(key, None)
            if not finished and replica.dead is None:
                with contextlib.suppress(Exception):
                    replica.actor.abort(key)
            if replica in self.router.load:
                self.router.load[replica] -= 1

    async def _pump(self, replica: Replica) -> None:
        """Read the replica's output stream (one message per engine step, every
        request's new tokens in it) and hand each output to its request's queue."""
        try:
            async for batch in replica.actor.outputs():
                for key, item in batch:
                    queue = replica.streams.get(key)
                    if queue is not None:
                        queue.put_nowait(item)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the actor died (or Ray did): its streams end
            self._lost(replica, f"died ({type(e).__name__})")
        else:
            self._lost(replica, "its output stream ended")


def _portable(error: Exception) -> Exception:
    """The error itself if it survives pickling (the router raises it again, so its
    status code holds), else a RuntimeError with its words: one request's odd error
    must not break the stream every request of the replica shares."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _hf_config(folder: Path) -> dict:
    import json

    path = folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


# ---------------------------------------------------------------- metrics


def collect(models: dict) -> Iterator[Metric]:
    """Scrape-time metrics of every Ray-replicated LLM (`models`: the repository's):
    per replica its health, load and prefix cache, and the router's decisions by rule."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["model", "version", "replica"]
    families = {
        "healthy": GaugeMetricFamily(
            "bitserve_llm_replica_healthy",
            "1 while the replica answers and is healthy.",
            labels=labels,
        ),
        "ongoing": GaugeMetricFamily(
            "bitserve_llm_replica_ongoing_requests",
            "Requests in flight on the replica.",
            labels=labels,
        ),
        "served": CounterMetricFamily(
            "bitserve_llm_replica_requests",
            "Requests the router sent to the replica.",
            labels=labels,
        ),
        "waiting": GaugeMetricFamily(
            "bitserve_llm_replica_num_requests_waiting",
            "The replica engine's waiting queue.",
            labels=labels,
        ),
        "kv": GaugeMetricFamily(
            "bitserve_llm_replica_kv_cache_usage_perc",
            "The replica's KV blocks in use.",
            labels=labels,
        ),
        "queries": CounterMetricFamily(
            "bitserve_llm_replica_prefix_cache_queries", "Prompt tokens looked up.", labels=labels
        ),
        "hits": CounterMetricFamily(
            "bitserve_llm_replica_prefix_cache_hits", "Prompt tokens found cached.", labels=labels
        ),
    }
    rules = CounterMetricFamily(
        "bitserve_llm_route_decisions",
        "Requests routed, by the rule that chose the replica (prefix: longest cached "
        "prefix; least_loaded: no prefix cached anywhere; overloaded: the prefix's replica "
        "was past route_imbalance; sticky: the session key's replica; round_robin).",
        labels=["model", "version", "rule"],
    )
    replaced = CounterMetricFamily(
        "bitserve_llm_replicas_replaced",
        "Replicas started again after theirs was lost.",
        labels=["model", "version"],
    )
    for name, entry in models.items():
        for number, version in entry.versions.items():
            service = getattr(version.path, "service", None)
            if not isinstance(service, RayLLMService):
                continue
            where = [name, str(number)]
            for replica in service.replicas:
                row, m = [*where, str(replica.slot)], replica.metrics
                families["healthy"].add_metric(row, float(replica.usable()))
                families["ongoing"].add_metric(row, float(service.router.load.get(replica, 0)))
                families["served"].add_metric(row, float(replica.served))
                families["waiting"].add_metric(row, float(m.get("num_requests_waiting", 0)))
                families["kv"].add_metric(row, float(m.get("kv_cache_usage", 0)))
                families["queries"].add_metric(row, float(m.get("prefix_cache_queries", 0)))
                families["hits"].add_metric(row, float(m.get("prefix_cache_hits", 0)))
            for rule, count in service.router.decisions.items():
                rules.add_metric([*where, rule], float(count))
            replaced.add_metric(where, float(service.replaced))
    yield from (*families.values(), rules, replaced)
