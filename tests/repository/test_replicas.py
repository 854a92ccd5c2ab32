"""Ray replicas as the router sees them, with fake replicas (no Ray): a batch whose
replica died before starting it is retried on another, one that was running fails with
503, the dead replica is replaced, and the version serves degraded meanwhile."""

from __future__ import annotations

import asyncio
import textwrap

import numpy as np
import pytest

from bitserve.batching.batcher import DynamicBatcher, Request
from bitserve.batching.clock import LoopClock
from bitserve.config import ModelConfig
from bitserve.repository.paths import batched as batched_module
from bitserve.repository.replica import ReplicaGone
from bitserve.repository.version import ModelVersion, ReplicaLost

CONFIG = {
    "name": "m",
    "backend": "python",
    "max_batch_size": 4,
    "input": [{"name": "x", "datatype": "FP32", "dims": [1]}],
    "output": [{"name": "y", "datatype": "FP32", "dims": [1]}],
    "dynamic_batching": {},
    "instance_group": {"count": 2, "isolation": "ray", "num_cpus": 0.5},
}


class FakeReplica:
    """Answers each batch on the next loop turn; `doom` makes its next batch fail as a
    replica that died before (started=False) or while (True) running it."""

    started = 0

    def __init__(self, config, version_dir, slot, device, calls=None):
        self.slot, self.device = slot, device
        self.doom: bool | None = None
        self.is_alive = True
        self.batches: list[int] = []
        FakeReplica.started += 1

    async def start(self) -> None:
        await asyncio.sleep(0.01)

    def run(self, batch, done) -> None:
        self.batches.append(len(batch))
        loop = asyncio.get_running_loop()
        if self.doom is not None:
            self.is_alive = False
            error = ReplicaGone("replica died", started=self.doom)
            loop.call_soon(done, None, error)
            return
        outputs = [{"y": r.inputs["x"]} for r in batch]
        loop.call_soon(done, (outputs, 0.001), None)

    def alive(self) -> bool:
        return self.is_alive

    def busy_for(self) -> float:
        return 0.0

    def kill(self) -> None:
        self.is_alive = False

    async def stop(self) -> None:
        pass


def served_version(monkeypatch) -> ModelVersion:
    monkeypatch.setattr(batched_module, "Instance", FakeReplica)
    config = ModelConfig.model_validate(CONFIG)
    version = ModelVersion(config, 1, __import__("pathlib").Path("/nonexistent/1"))
    version.path.instances = [FakeReplica(config, None, i, "cpu") for i in range(2)]
    loop = asyncio.get_running_loop()
    version.path.batcher = DynamicBatcher(
        "m", 4, config.dynamic_batching, 2, version.path._execute, LoopClock(loop)
    )
    version.state = "ready"
    return version


def _raise(error: BaseException):
    async def handler(request):
        raise error

    return handler


def request(x: float) -> Request:
    return Request({"x": np.array([[x]], dtype=np.float32)}, 1, asyncio.get_running_loop().time())


async def test_a_batch_not_started_on_a_dead_replica_runs_on_another(monkeypatch):
    version = served_version(monkeypatch)
    doomed = version.path.instances[0]  # the batcher hands out slot 0 first
    doomed.doom = False
    futures = [version.path.submit(request(float(i))) for i in range(3)]
    answers = await asyncio.wait_for(asyncio.gather(*futures), 2)
    assert [float(a["y"][0, 0]) for a in answers] == [0.0, 1.0, 2.0]
    assert version.path.retried >= 1
    assert version.ready  # the other replica serves while slot 0 is replaced
    assert version.degraded() is not None or 0 not in version.path.unhealthy
    await asyncio.sleep(0.1)
    assert not version.path.unhealthy and version.degraded() is None
    assert version.path.instances[0] is not doomed  # a fresh replica took the slot
    assert version.path.restarts["died"] == 1


async def test_a_batch_running_on_a_replica_that_dies_fails_with_503(monkeypatch):
    from bitserve.server.errors import handle, status_of

    version = served_version(monkeypatch)
    version.path.instances[0].doom = True
    first = version.path.submit(request(1.0))
    with pytest.raises(ReplicaLost) as caught:
        await asyncio.wait_for(first, 2)
    assert status_of(caught.value) == 503 and "retry" in str(caught.value)
    response = await handle(_raise(caught.value))(None)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert version.ready  # degraded: one replica left
    answer = await asyncio.wait_for(version.path.submit(request(2.0)), 2)
    assert float(answer["y"][0, 0]) == 2.0
    await asyncio.sleep(0.1)
    assert not version.path.unhealthy


async def test_not_ready_only_when_every_replica_is_down(monkeypatch):
    version = served_version(monkeypatch)
    version.path.unhealthy = {0}
    assert version.ready and "1 of 2 replicas healthy" in version.degraded()
    assert version.problem() is None  # a lost replica is not a liveness failure
    version.path.unhealthy = {0, 1}
    assert not version.ready and version.degraded() is None


def test_the_batcher_puts_a_retried_batch_back_first():
    from bitserve.batching.clock import ManualClock

    ran: list[list[Request]] = []
    clock = ManualClock()
    batcher = DynamicBatcher("m", 2, None, 1, lambda slot, batch: ran.append(batch), clock)
    first, second = Request({}, 1, 0.0), Request({}, 1, 0.0)
    batcher.submit(first)
    batcher.submit(second)  # queued behind the running one
    assert ran == [[first]] and batcher.queued == 1
    batcher.requeue(ran[0])
    assert batcher.queued == 2 and first.state == "queued"
    batcher.release(0)
    assert ran[1] == [first]  # the retried request leaves before the one behind it


def test_config_table_is_checked():
    from bitserve.config import InstanceGroup

    assert InstanceGroup(isolation="ray").ray_resources() == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert InstanceGroup(isolation="ray", kind="gpu").ray_resources()["num_gpus"] == 1.0
    with pytest.raises(ValueError, match='isolation = "ray"'):
        InstanceGroup(num_cpus=2)
    with pytest.raises(ValueError, match="choose one"):
        InstanceGroup(isolation="ray", kind="cpu", num_gpus=1)
    with pytest.raises(ValueError, match='isolation = "ray"'):
        InstanceGroup(kind="ray", count=2)
    llm = {"name": "m", "backend": "llm", "instance_group": {"isolation": "ray"}}
    assert ModelConfig.model_validate(llm).instance_group.isolation == "ray"  # llmreplicas.py


def test_serving_code_does_not_import_ray():
    import subprocess
    import sys

    code = textwrap.dedent(
        """
        import sys
        import bitserve.cli, bitserve.server.app, bitserve.repository.replica
        assert "ray" not in sys.modules, "ray imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_replica_no_node_can_hold_is_refused_on_a_local_ray_only(monkeypatch, caplog):
    from bitserve import raycluster
    from bitserve.backends.base import LoadError
    from bitserve.repository import replica

    class OneCpuCluster:
        @staticmethod
        def nodes():
            return [{"Alive": True, "Resources": {"CPU": 1.0}}]

    gpu = {"num_cpus": 1.0, "num_gpus": 1.0}
    monkeypatch.setattr(raycluster, "_address", "local")
    with pytest.raises(LoadError, match="no Ray node has 1 CPU and 1 GPU"):
        replica._check_feasible(OneCpuCluster, "m", gpu)
    monkeypatch.setattr(raycluster, "_address", "10.0.0.1:6379")
    replica._check_feasible(OneCpuCluster, "m", gpu)  # an autoscaler may add the node
    assert "autoscaler" in caplog.text
    replica._check_feasible(OneCpuCluster, "m", {"num_cpus": 1.0, "num_gpus": 0.0})
