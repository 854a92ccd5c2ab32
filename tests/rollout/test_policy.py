"""Routing by the traffic policy, its validation, promote and rollback."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from scipy import stats as sp

from bitserve.config import ConfigError, Traffic, load_config
from bitserve.metrics import Metrics
from bitserve.repository.repository import Repository
from bitserve.rollout import policy
from bitserve.rollout.state import ModelRollout
from tests.conftest import XY_CONFIG, write_model


def _entry(*numbers: int, down: tuple[int, ...] = ()) -> SimpleNamespace:
    versions = {n: SimpleNamespace(version=n, ready=n not in down) for n in numbers}
    return SimpleNamespace(name="m", config=None, versions=versions)


def _rollout(traffic: Traffic, seed: int = 1) -> ModelRollout:
    return ModelRollout("m", traffic, Metrics(), random.Random(seed))


def test_canary_share_over_2000_requests_is_within_the_binomial_99_interval():
    rollout = _rollout(Traffic(stable=1, canary=2, canary_weight=10))
    entry = _entry(1, 2)
    n = 2000
    canary = sum(rollout.route(entry).version.version == 2 for _ in range(n))
    low, high = sp.binom.ppf(0.005, n, 0.10), sp.binom.ppf(0.995, n, 0.10)
    assert low <= canary <= high, (canary, low, high)


def test_shadow_mirrors_its_percent_of_stable_requests_only():
    rollout = _rollout(Traffic(stable=1, canary=2, canary_weight=50, shadow=3, shadow_percent=20))
    entry = _entry(1, 2, 3)
    routes = [rollout.route(entry) for _ in range(4000)]
    assert all(r.shadow is None for r in routes if r.role == "canary")
    stable = [r for r in routes if r.role == "stable"]
    mirrored = sum(r.shadow is not None for r in stable)
    n = len(stable)
    assert sp.binom.ppf(0.005, n, 0.2) <= mirrored <= sp.binom.ppf(0.995, n, 0.2)
    assert {r.version.version for r in routes} == {1, 2}  # the shadow never answers


def test_a_canary_that_is_not_ready_falls_back_to_stable():
    rollout = _rollout(Traffic(stable=1, canary=2, canary_weight=100))
    assert {rollout.route(_entry(1, 2, down=(2,))).version.version for _ in range(50)} == {1}


def test_policy_errors_name_the_field():
    with pytest.raises(policy.PolicyError, match=r"traffic\.canary_weight"):
        policy.parse({"stable": 1, "canary": 2, "canary_weight": 150}, [1, 2])
    with pytest.raises(policy.PolicyError, match=r"traffic\.canary'?: version 3 is not served"):
        policy.parse({"stable": 1, "canary": 3}, [1, 2])
    with pytest.raises(policy.PolicyError, match="is the stable version"):
        policy.parse({"stable": 1, "canary": 1}, [1, 2])
    with pytest.raises(policy.PolicyError, match=r"needs traffic\.canary"):
        policy.parse({"stable": 1, "canary_weight": 5}, [1, 2])
    with pytest.raises(policy.PolicyError, match=r"traffic\.stable"):
        policy.parse({"canary": 2}, [1, 2])


def test_patch_merges_over_the_current_policy():
    base = Traffic(stable=1, canary=2, canary_weight=10, rollback={"min_requests": 500})
    merged = policy.parse({"canary_weight": 30, "rollback": {"alpha": 0.001}}, [1, 2], base)
    assert (merged.stable, merged.canary, merged.canary_weight) == (1, 2, 30)
    assert (merged.rollback.min_requests, merged.rollback.alpha) == (500, 0.001)


def test_promote_and_rollback():
    traffic = Traffic(stable=1, canary=2, canary_weight=10, shadow=3)
    promoted = policy.promote(traffic)
    assert (promoted.stable, promoted.canary, promoted.canary_weight, promoted.shadow) == (
        2,
        None,
        0,
        3,
    )
    assert policy.promote(promoted).stable == 3  # no canary: the shadow is promoted
    back = policy.rollback(traffic)
    assert (back.stable, back.canary, back.canary_weight, back.shadow_percent) == (1, 2, 0, 0)
    with pytest.raises(policy.PolicyError):
        policy.rollback(Traffic(stable=1))


def _traffic_model(root: Path, policy_lines: str, versions=(1, 2)) -> Path:
    folder = write_model(root, "m", XY_CONFIG + policy_lines)
    for v in versions:
        (folder / str(v)).mkdir(exist_ok=True)
    return folder


def test_config_toml_names_a_version_the_policy_does_not_serve(tmp_path):
    folder = _traffic_model(
        tmp_path, "[version_policy]\nspecific = [1]\n[traffic]\nstable = 1\ncanary = 2\n"
    )
    with pytest.raises(ConfigError, match=r"config.toml: .*traffic\.canary'?: version 2 is not"):
        load_config(folder / "config.toml")


def test_repository_refuses_a_policy_on_versions_the_latest_policy_drops(tmp_path):
    _traffic_model(tmp_path, "[traffic]\nstable = 1\ncanary = 2\ncanary_weight = 5\n")
    repository = Repository(tmp_path)
    repository.scan()
    assert "field 'traffic.stable': version 1 is not served" in repository.models["m"].error
    (tmp_path / "m" / "config.toml").write_text(
        XY_CONFIG + "[version_policy]\nall = true\n[traffic]\nstable = 1\ncanary = 2\n"
    )
    repository.scan()
    assert repository.models["m"].error is None
    assert repository.models["m"].config.traffic.canary == 2
