"""One model's rollout at run time: its policy, what each version did, the shadow's
comparisons, and the automatic rollback; and `Rollouts`, the server's set of them.

A model without a `[traffic]` table costs the request path one dict lookup. The policy
in force comes from config.toml and is replaced through the admin API; reloading the
model (a new config) starts again from its config.toml.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from bitserve.config import ModelConfig, Traffic
from bitserve.metrics import Metrics
from bitserve.repository.repository import ModelEntry, ModelUnavailable, Repository
from bitserve.repository.version import ModelVersion
from bitserve.rollout import guard, policy, shadow
from bitserve.rollout.compare import Comparisons, Record, compare_outputs
from bitserve.rollout.window import Window

log = logging.getLogger("bitserve.rollout")


@dataclass
class Route:
    """Where one unpinned request goes; `finish` reports how it went."""

    rollout: ModelRollout
    version: ModelVersion
    role: str  # stable | canary
    shadow: ModelVersion | None

    def finish(self, status: int, seconds: float, parsed: Any, outputs: Any) -> None:
        self.rollout.finish(self, status, seconds, parsed, outputs)


@dataclass
class Snapshot:
    """A copy of a rollout's figures, for a report computed off the event loop."""

    name: str
    policy: Traffic
    windows: dict[int, Window]
    comparisons: dict
    events: list[dict]

    def window(self, version: int) -> Window:
        return self.windows.get(version) or Window(self.policy.window)


def counts_as_error(status: int) -> bool:
    """Server-side failures count against a version; a caller's mistakes (4xx) do not,
    except 429: a version that sheds load is failing its callers."""
    return status >= 500 or status == 429


class ModelRollout:
    def __init__(
        self,
        name: str,
        traffic: Traffic,
        metrics: Metrics,
        rng: random.Random | None = None,
        action: str = "configured",
        reason: str = "config.toml",
    ):
        self.name = name
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.windows: dict[int, Window] = {}
        self.comparisons = Comparisons()
        self.events: deque[dict] = deque(maxlen=50)
        self.policy = traffic
        self.mirror: shadow.Mirror | None = None
        self._canary_label: str | None = None
        self.set_policy(traffic, action, reason)

    # ------------------------------------------------------------- policy

    def set_policy(self, traffic: Traffic, action: str, reason: str) -> None:
        old = self.policy
        self.policy = traffic
        self.canary_requests = 0  # since the policy was set: drives the rollback checks
        self.looks = 0
        for window in self.windows.values():
            window.resize(traffic.window)
        if self.mirror is None or (old.shadow_queue_size, old.shadow_concurrency) != (
            traffic.shadow_queue_size,
            traffic.shadow_concurrency,
        ):
            self._new_mirror(traffic)
        self._export_weight()
        self.events.append(
            {"time": time.time(), "action": action, "reason": reason, "policy": _brief(traffic)}
        )
        log_at = logging.WARNING if action == "auto-rollback" else logging.INFO
        log.log(log_at, "model %s traffic %s (%s): %s", self.name, action, reason, _brief(traffic))

    def _new_mirror(self, traffic: Traffic) -> None:
        if self.mirror is not None:
            self.mirror.close()
        self.mirror = shadow.Mirror(
            traffic.shadow_queue_size,
            traffic.shadow_concurrency,
            self._run_shadow,
            self.metrics.shadow_sent.labels(self.name),
            self.metrics.shadow_dropped.labels(self.name),
        )

    def _export_weight(self) -> None:
        gauge = self.metrics.canary_weight
        canary = self.policy.canary
        label = str(canary) if canary is not None else None
        if self._canary_label is not None and self._canary_label != label:
            gauge.remove(self.name, self._canary_label)
        if label is not None:
            gauge.labels(self.name, label).set(self.policy.canary_weight)
        self._canary_label = label

    def close(self) -> None:
        if self.mirror is not None:
            self.mirror.close()

    def snapshot(self) -> Snapshot:
        return Snapshot(
            self.name,
            self.policy,
            {v: w.copy() for v, w in self.windows.items()},
            self.comparisons.summary(),
            list(self.events),
        )

    # ------------------------------------------------------------ requests

    def route(self, entry: ModelEntry) -> Route:
        decision = policy.decide(self.policy, self.rng.random)
        chosen = entry.versions.get(decision.version)
        role = decision.role
        if role == "canary" and (chosen is None or not chosen.ready):
            chosen, role = entry.versions.get(self.policy.stable), "stable"  # canary down
        if chosen is None or not chosen.ready:
            state = "not loaded" if chosen is None else chosen.state
            raise ModelUnavailable(
                f"model '{self.name}': stable version {self.policy.stable} is {state}"
            )
        mirror = None
        if role == "stable" and decision.mirror and self.policy.shadow is not None:
            mirror = entry.versions.get(self.policy.shadow)
        return Route(self, chosen, role, mirror)

    def window(self, version: int) -> Window:
        found = self.windows.get(version)
        if found is None:
            found = self.windows[version] = Window(self.policy.window)
        return found

    def finish(self, route: Route, status: int, seconds: float, parsed: Any, outputs: Any) -> None:
        """Record a routed request; check the canary; offer the copy to the shadow. The
        primary's answer is already made: nothing here may fail it."""
        try:
            self._finish(route, status, seconds, parsed, outputs)
        except Exception:
            log.exception("model %s: recording a rollout request failed", self.name)

    def _finish(self, route: Route, status: int, seconds: float, parsed: Any, outputs: Any) -> None:
        ok = not counts_as_error(status)
        if status >= 400 and ok:
            return  # the caller's mistake says nothing about the version
        self.window(route.version.version).add(seconds, ok)
        if route.role == "canary":
            self.canary_requests += 1
            self._check_canary()
        if route.shadow is not None and parsed is not None and self.mirror is not None:
            if not route.shadow.ready:
                self.mirror.dropped.inc()
                return
            self.mirror.offer(
                shadow.MirrorJob(route.shadow, parsed, route.version.version, seconds, ok, outputs)
            )

    def _check_canary(self) -> None:
        traffic, rule = self.policy, self.policy.rollback
        if not rule.enabled or traffic.canary is None or not traffic.canary_weight:
            return
        if self.canary_requests % rule.check_every:
            return
        stable, canary = self.window(traffic.stable), self.window(traffic.canary)
        if not guard.ready(rule, stable, canary):
            return
        self.looks += 1
        reason = guard.check(rule, self.looks, stable, canary)
        if reason is not None:
            self.metrics.rollbacks.labels(self.name, str(traffic.canary)).inc()
            self.set_policy(policy.rollback(traffic), "auto-rollback", reason)

    async def _run_shadow(self, job: shadow.MirrorJob) -> None:
        started = time.perf_counter()
        error, outputs = None, None
        try:
            outputs = await shadow.run(job.shadow, job.parsed)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - started
        self.window(job.shadow.version).add(seconds, error is None)
        both = error is None and job.primary_ok and job.primary_outputs is not None
        figures = compare_outputs(job.primary_outputs, outputs, self.policy.compare) if both else {}
        self.comparisons.add(
            Record(
                primary=job.primary,
                shadow=job.shadow.version,
                primary_ms=job.primary_seconds * 1000,
                shadow_ms=seconds * 1000,
                primary_ok=job.primary_ok,
                shadow_ok=error is None,
                shadow_error=error,
                outputs=figures,
            )
        )


class Rollouts:
    """The server's rollouts, one per model that has a traffic policy."""

    def __init__(self, repository: Repository, metrics: Metrics):
        self.repository = repository
        self.metrics = metrics
        # model -> (the config it was made for, its rollout or None without a policy)
        self.models: dict[str, tuple[ModelConfig, ModelRollout | None]] = {}

    def route(self, name: str) -> Route | None:
        """Where an unpinned request for `name` goes; None when no policy applies."""
        entry = self.repository.models.get(name)
        if entry is None:
            return None
        rollout = self.get(entry)
        return rollout.route(entry) if rollout is not None else None

    def get(self, entry: ModelEntry) -> ModelRollout | None:
        """The model's rollout; None without a policy or without a valid config."""
        if entry.config is None:
            return None
        known = self.models.get(entry.name)
        if known is not None and known[0] is entry.config:
            return known[1]
        if known is not None and known[1] is not None:
            known[1].close()  # reloaded: start again from the new config.toml
        traffic = entry.config.traffic
        rollout = ModelRollout(entry.name, traffic, self.metrics) if traffic else None
        self.models[entry.name] = (entry.config, rollout)
        return rollout

    def set(self, entry: ModelEntry, traffic: Traffic, action: str, reason: str) -> ModelRollout:
        rollout = self.get(entry)
        if rollout is None:
            assert entry.config is not None
            rollout = ModelRollout(entry.name, traffic, self.metrics, action=action, reason=reason)
            self.models[entry.name] = (entry.config, rollout)
        else:
            rollout.set_policy(traffic, action, reason)
        return rollout

    def clear(self, entry: ModelEntry) -> None:
        """No policy until the model reloads: the highest version answers again."""
        rollout = self.get(entry)
        if rollout is not None:
            rollout.close()
            if rollout._canary_label is not None:
                self.metrics.canary_weight.remove(entry.name, rollout._canary_label)
            log.info("model %s: traffic policy removed (admin API)", entry.name)
        assert entry.config is not None
        self.models[entry.name] = (entry.config, None)

    def close(self) -> None:
        for _, rollout in self.models.values():
            if rollout is not None:
                rollout.close()


def _brief(traffic: Traffic) -> str:
    parts = [f"stable {traffic.stable}"]
    if traffic.canary is not None:
        parts.append(f"canary {traffic.canary} at {traffic.canary_weight:g}%")
    if traffic.shadow is not None:
        parts.append(f"shadow {traffic.shadow} on {traffic.shadow_percent:g}%")
    return ", ".join(parts)
