"""Safe rollout: canary and shadow traffic, output comparison, and a statistical verdict.

    policy.py   which version answers an unpinned request; promote, rollback
    shadow.py   the bounded queue of request copies and the workers that run them
    compare.py  a mirrored request's two answers side by side (numbers, classes, text)
    window.py   each version's latest requests, the sample the statistics read
    stats.py    intervals (normal or bootstrap), t / Mann-Whitney / z tests, sample sizes
    guard.py    the automatic rollback rule, with alpha spent over repeated checks
    state.py    one model's rollout at run time, and the server's set of them
    verdict.py  the report: per version, per candidate, and a recommendation
    command.py  `bitserve rollout report|set|promote|rollback`

The policy is a model's `[traffic]` table (bitserve/config.py); the server
routes v2 infer through `ServerState.route_model` (server/state.py) and records each request
in `state.py`.
"""
