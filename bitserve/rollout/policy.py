"""The traffic policy: which version answers a request, and whether it is mirrored.

A model's `[traffic]` table (config.toml, or the admin API at run time) names a
`stable` version, optionally a `canary` that answers `canary_weight` percent of the
requests, and a `shadow` that gets a copy of `shadow_percent` percent of stable's
requests. A request that pins a version (`/versions/{v}/infer`, or the header
`bitserve-model-version`) bypasses the policy: it is never rerouted nor mirrored.

    [traffic]
    stable = 1
    canary = 2
    canary_weight = 10      # percent
    shadow = 3
    shadow_percent = 100
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from bitserve.config import Traffic

VERSION_HEADER = "bitserve-model-version"


class PolicyError(ValueError):
    """A traffic policy that cannot be used; the message names the field (HTTP 400)."""


@dataclass(frozen=True)
class Decision:
    version: int
    role: str  # stable | canary
    mirror: bool  # also send a copy to the shadow


def decide(traffic: Traffic, draw: Callable[[], float]) -> Decision:
    """Route one unpinned request; `draw` gives uniform numbers in [0, 1)."""
    if traffic.canary is not None and draw() * 100 < traffic.canary_weight:
        return Decision(traffic.canary, "canary", False)
    mirror = traffic.shadow is not None and draw() * 100 < traffic.shadow_percent
    return Decision(traffic.stable, "stable", mirror)


def parse(doc: Any, served: list[int], base: Traffic | None = None) -> Traffic:
    """A policy from a JSON document (merged over `base` when given), checked against
    the versions the model serves."""
    if not isinstance(doc, dict):
        raise PolicyError("the traffic policy must be a JSON object")
    merged = {**(base.model_dump() if base else {}), **doc}
    if base is not None and isinstance(doc.get("rollback"), dict):
        merged["rollback"] = {**base.rollback.model_dump(), **doc["rollback"]}
    try:
        traffic = Traffic.model_validate(merged)
    except ValidationError as e:
        problems = "; ".join(
            f"field 'traffic.{'.'.join(str(p) for p in err['loc'])}': {err['msg']}"
            if err["loc"]
            else err["msg"]
            for err in e.errors()
        )
        raise PolicyError(problems) from None
    problem = traffic.unserved(served)
    if problem:
        raise PolicyError(problem)
    return traffic


def promote(traffic: Traffic) -> Traffic:
    """The canary (else the shadow) becomes stable and takes all the traffic."""
    winner = traffic.canary if traffic.canary is not None else traffic.shadow
    if winner is None:
        raise PolicyError("nothing to promote: the policy names no canary and no shadow")
    shadow = None if traffic.shadow == winner else traffic.shadow
    return traffic.model_copy(
        update={"stable": winner, "canary": None, "canary_weight": 0.0, "shadow": shadow}
    )


def rollback(traffic: Traffic) -> Traffic:
    """Stable takes all the traffic again: the canary's weight drops to 0 and the
    shadow stops receiving copies. The versions stay named, for the report."""
    if traffic.canary is None and traffic.shadow is None:
        raise PolicyError("nothing to roll back: the policy names no canary and no shadow")
    return traffic.model_copy(update={"canary_weight": 0.0, "shadow_percent": 0.0})
