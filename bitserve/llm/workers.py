"""The worker ranks of tensor/pipeline parallelism: started, watched, stopped.

Rank 0 is the engine's own process. Ranks 1.. run `worker_main`: connect the groups
(parallel.py), load their share of the model, then run every step rank 0 broadcasts
(`ModelRunner.run`), in lockstep, until it broadcasts None.

Where they run (`EngineConfig.distributed_executor`):
- "mp" (default): local processes started with `spawn` (a fresh interpreter: no
  forked OpenMP or CUDA state), rank r on `cuda:r` when the engine is on a GPU;
- "ray": Ray actors in a placement group, one bundle per worker (`{"CPU": threads}`,
  plus a GPU on cuda), strategy `placement_strategy` (PACK by default: TP ranks want
  one node; SPREAD puts pipeline stages on different nodes). The cluster is the one
  this process is connected to, else the one `bitserve serve --ray ADDRESS` names
  (raycluster.py), else `RAY_ADDRESS`, else a Ray of this process's own. The model
  folder must exist at the same path on every node, and gloo must reach each node
  (GLOO_SOCKET_IFNAME names the interface when the default one is wrong).

Rendezvous: rank 0 opens a TCPStore on port 0 (the OS picks a free one, no race) and
hands its address to the workers. Failure is loud, never a hang: before each step
rank 0 checks that every worker is alive; a worker that dies mid-step makes the next
collective fail at once (gloo sees the closed socket) or after `distributed_timeout_s`
(a hung peer, NCCL); a worker's own exception is written to the store, so the error
names the rank and what it raised; after a failure every worker is stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from bitserve.llm.config import EngineConfig
from bitserve.llm.parallel import Parallel, init_parallel
from bitserve.tensors import allow_tf32

POLL_S = 0.05
STOP_TIMEOUT_S = 10.0
DEATH_GRACE_S = 2.0


class WorkerDied(RuntimeError):
    """A tensor/pipeline worker exited or a collective with the workers failed."""


def worker_main(config: EngineConfig, rank: int, host: str, port: int, threads: int) -> None:
    """A worker rank: connect, load this rank's share of the model, run steps until None."""
    import torch.distributed as dist

    from bitserve.llm.model_runner import EXPERT_COUNTS, ModelRunner

    torch.set_num_threads(threads)
    timeout = timedelta(seconds=config.startup_timeout_s)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    store.set(f"started/{rank}", str(os.getpid()))
    try:
        if not config.on_cpu:  # rank r on a GPU of its own (EngineConfig.rank_device)
            config = dataclasses.replace(config, device=config.rank_device(rank))
            torch.cuda.set_device(config.torch_device)
            allow_tf32(config.device)
        parallel = init_parallel(config, rank, store)
        runner = ModelRunner(config, parallel)
        while (message := parallel.receive_object()) is not None:
            if message == EXPERT_COUNTS:
                runner.send_tokens_per_expert()
            else:
                runner.run(message)
    except BaseException:
        with contextlib.suppress(Exception):  # rank 0 gone with its store: nobody to tell
            store.set(f"error/{rank}", traceback.format_exc())
        raise


def local_worker_main(*args) -> None:
    """A spawned worker: after a clean stop, leave without the interpreter's teardown
    (tearing down torch and the gloo groups takes ~1 s, per engine shutdown)."""
    worker_main(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LocalWorkers:
    """Ranks 1.. as spawned processes on this machine."""

    host = "127.0.0.1"

    def __init__(self, config: EngineConfig):
        self.config = config
        self.procs: dict[int, Any] = {}

    def start(self, port: int, threads: int) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        for rank in range(1, self.config.world_size):
            proc = ctx.Process(
                target=local_worker_main,
                args=(self.config, rank, self.host, port, threads),
                name=f"bitserve-llm-rank{rank}",
                daemon=True,
            )
            proc.start()
            self.procs[rank] = proc

    def dead(self) -> dict[int, str]:
        return {
            rank: f"pid {proc.pid} exited with code {proc.exitcode}"
            for rank, proc in self.procs.items()
            if not proc.is_alive()
        }

    def stop(self, grace: float = STOP_TIMEOUT_S) -> None:
        """Wait `grace` seconds for the workers to leave, then kill those left."""
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=STOP_TIMEOUT_S)


class RankActor:
    """A Ray actor whose one long call is the worker loop."""

    def run(self, config: EngineConfig, rank: int, host: str, port: int, threads: int) -> None:
        worker_main(config, rank, host, port, threads)


class RayWorkers:
    """Ranks 1.. as Ray actors, one placement-group bundle each."""

    CHECK_EVERY_S = 1.0  # ray.wait costs more than a waitpid: look once a second

    def __init__(self, config: EngineConfig):
        from bitserve import raycluster

        try:
            import ray
        except ImportError:
            raise raycluster.RayUnavailable(
                "distributed_executor='ray' needs Ray: pip install 'bitserve[ray]'"
            ) from None
        if ray.is_initialized():
            pass
        elif raycluster.address() is not None:  # bitserve serve --ray ADDRESS
            raycluster.connect()
        else:  # RAY_ADDRESS, else a Ray of this process's own
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
        self.config = config
        self.host = ray.util.get_node_ip_address()
        self.actors: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}
        self.group = None
        self.last_check = 0.0
        self.finished: dict[int, str] = {}

    def start(self, port: int, threads: int) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = 0 if self.config.on_cpu else 1
        bundle = {"CPU": threads} | ({"GPU": gpus} if gpus else {})
        workers = self.config.world_size - 1
        self.group = placement_group([bundle] * workers, strategy=self.config.placement_strategy)
        ready, _ = ray.wait([self.group.ready()], timeout=self.config.distributed_timeout_s)
        if not ready:
            raise WorkerDied(
                f"the Ray cluster cannot place {workers} worker(s) of {bundle} "
                f"({self.config.placement_strategy}) within {self.config.distributed_timeout_s} s"
            )
        actor_class = ray.remote(RankActor)
        for rank in range(1, self.config.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=rank - 1
            )
            actor = actor_class.options(
                num_cpus=threads, num_gpus=gpus, scheduling_strategy=strategy
            ).remote()
            self.actors[rank] = actor
            self.runs[rank] = actor.run.remote(self.config, rank, self.host, port, threads)

    def dead(self) -> dict[int, str]:
        import ray

        now = time.monotonic()
        if now - self.last_check < self.CHECK_EVERY_S and not self.finished:
            return {}
        self.last_check = now
        pending = [ref for rank, ref in self.runs.items() if rank not in self.finished]
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for rank, ref in self.runs.items():
            if ref in done and rank not in self.finished:
                try:
                    ray.get(ref)
                    self.finished[rank] = "the actor's worker loop returned"
                except Exception as error:
                    self.finished[rank] = f"the actor failed: {error!r}"[:2000]
        return dict(self.finished)

    def stop(self, grace: float = STOP_TIMEOUT_S) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.runs and grace > 0:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=grace)
        for actor in self.actors.values():
            ray.kill(actor)
        if self.group is not None:
            remove_placement_group(self.group)
        self.actors, self.runs, self.group = {}, {}, None  # a second stop does nothing


class Workers:
    """Rank 0's handle on the other ranks: start them, connect, check, stop."""

    def __init__(self, config: EngineConfig):
        import torch.distributed as dist

        self.config = config
        ray = config.distributed_executor == "ray"
        self.launcher = RayWorkers(config) if ray else LocalWorkers(config)
        timeout = timedelta(seconds=config.startup_timeout_s)
        self.store = dist.TCPStore(
            self.launcher.host, 0, is_master=True, wait_for_workers=False, timeout=timeout
        )
        self.stopped: str | None = None
        # stops the workers at once, only once: on failure, or when the engine is dropped
        self._kill = weakref.finalize(self, self.launcher.stop, 0.0)
        if not config.on_cpu:  # NCCL works on the current device
            torch.cuda.set_device(config.torch_device)
        try:
            self.launcher.start(self.store.port, torch.get_num_threads())
            self.wait_started()
            self.parallel: Parallel = init_parallel(config, 0, self.store)
        except WorkerDied:  # a placement that never came, a worker that died starting
            self._kill()
            raise
        except BaseException as error:
            self.fail(error)

    def wait_started(self) -> None:
        """Until every worker has reached its rendezvous, watching for one that died
        on the way (an import or a CUDA error), so a dead worker is not a long wait."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        keys = [f"started/{rank}" for rank in range(1, self.config.world_size)]
        while not self.store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise WorkerDied(f"workers did not start in {self.config.startup_timeout_s} s")
            time.sleep(POLL_S)

    def check(self) -> None:
        """Raise WorkerDied if a worker has exited (called before each step)."""
        if self.stopped is not None:
            raise WorkerDied(self.stopped)
        dead = self.launcher.dead()
        if dead:
            self.fail(None, dead)

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Around rank 0's work with the workers: refused if a worker has exited; an
        error inside (a worker died or hung mid-collective) stops every worker and comes
        out as WorkerDied, naming the rank."""
        self.check()
        try:
            yield
        except Exception as error:
            self.fail(error)

    def fail(self, error: BaseException | None, dead: dict[int, str] | None = None):
        """Stop every worker and raise WorkerDied naming the ranks that died and why."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while not dead and time.monotonic() < deadline:  # a collective failed because a
            time.sleep(POLL_S)  # worker is dying: give its exit a moment to be seen
            dead = self.launcher.dead()
        lines = [f"rank {rank}: {why}{self.worker_error(rank)}" for rank, why in dead.items()]
        if not lines:
            lines = [f"a collective with the workers failed: {error!r}"]
        world = f"tensor_parallel_size={self.config.tensor_parallel_size}, "
        world += f"pipeline_parallel_size={self.config.pipeline_parallel_size}"
        self.stopped = f"LLM engine workers ({world}) failed: " + "; ".join(lines)
        self._kill()  # the group is broken: the other workers are of no use
        raise WorkerDied(self.stopped) from error

    def worker_error(self, rank: int) -> str:
        """What the worker wrote before it died, or why it may not have started."""
        with contextlib.suppress(Exception):  # the store itself may be what failed
            if self.store.check([f"error/{rank}"]):
                return "\n" + self.store.get(f"error/{rank}").decode(errors="replace")
            local = isinstance(self.launcher, LocalWorkers)
            if local and not self.store.check([f"started/{rank}"]):
                return (
                    " before it started (see its stderr; a script that starts a parallel "
                    "engine needs `if __name__ == '__main__':`, since spawned workers "
                    "import it again)"
                )
        return ""

    def kill(self) -> None:
        """Stop every worker now, without a word to them."""
        self.stopped = self.stopped or "the engine was shut down"
        self._kill()

    def shutdown(self) -> None:
        """Tell every worker to leave its loop, then wait for it (kill after a timeout)."""
        if self.stopped is None:
            self.stopped = "the engine was shut down"
            with contextlib.suppress(Exception):  # a worker already gone: stop() ends the rest
                self.parallel.broadcast_object(None)
        if self._kill.detach() is not None:  # not stopped yet: let them leave
            self.launcher.stop()
