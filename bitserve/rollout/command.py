"""`bitserve rollout`: read a running server's verdict, promote or roll back by hand.

bitserve rollout report minilm --url http://127.0.0.1:8000
bitserve rollout set minilm --canary 2 --weight 10
bitserve rollout promote minilm          # the admin token from BITSERVE_ADMIN_TOKEN
bitserve rollout rollback minilm
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import click

DEFAULT_URL = "http://127.0.0.1:8000"


@click.group()
def rollout() -> None:
    """Canary and shadow rollouts on a running server."""


def _url_option(f: Any) -> Any:
    return click.option(
        "--url", default=DEFAULT_URL, show_default=True, envvar="BITSERVE_URL", help="Server."
    )(f)


def _token_option(f: Any) -> Any:
    return click.option(
        "--token",
        envvar="BITSERVE_ADMIN_TOKEN",
        help="The server's --admin-token (default: BITSERVE_ADMIN_TOKEN).",
    )(f)


@rollout.command()
@click.argument("model")
@_url_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def report(model: str, url: str, as_json: bool) -> None:
    """Per version counts, error rate and latency with intervals; tests; a verdict."""
    doc = _call("GET", f"{url}/v2/models/{model}/rollout")
    click.echo(json.dumps(doc, indent=2) if as_json else render(doc))


@rollout.command()
@click.argument("model")
@_url_option
@_token_option
def promote(model: str, url: str, token: str | None) -> None:
    """Make the canary (else the shadow) the stable version, with all the traffic."""
    policy = _call("POST", f"{url}/v2/repository/models/{model}/traffic/promote", token)
    click.echo(f"{model}: stable is now version {policy['stable']}")


@rollout.command()
@click.argument("model")
@_url_option
@_token_option
def rollback(model: str, url: str, token: str | None) -> None:
    """Send every request to stable again (canary weight 0, no shadow copies)."""
    policy = _call("POST", f"{url}/v2/repository/models/{model}/traffic/rollback", token)
    click.echo(f"{model}: all traffic on stable version {policy['stable']}")


@rollout.command(name="set")
@click.argument("model")
@_url_option
@_token_option
@click.option("--stable", type=int)
@click.option("--canary", type=int)
@click.option("--weight", type=float, help="Canary weight, percent.")
@click.option("--shadow", type=int)
@click.option("--shadow-percent", type=float)
def set_policy(model: str, url: str, token: str | None, **fields: Any) -> None:
    """Change some fields of the traffic policy (the rest stay as they are)."""
    names = {"weight": "canary_weight"}
    doc = {names.get(k, k): v for k, v in fields.items() if v is not None}
    policy = _call("PATCH", f"{url}/v2/repository/models/{model}/traffic", token, doc)
    click.echo(json.dumps(policy, indent=2))


def _call(method: str, url: str, token: str | None = None, doc: Any = None) -> Any:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(doc).encode() if doc is not None else b"" if method != "GET" else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read()).get("error", e.reason)
        except (ValueError, AttributeError):
            message = e.reason
        raise click.ClickException(f"{method} {url}: {e.code} {message}") from None
    except urllib.error.URLError as e:
        raise click.ClickException(f"{method} {url}: {e.reason}") from None


# ---------------------------------------------------------------------- text


def render(doc: dict) -> str:
    lines = [f"model {doc['model']}: confidence level {doc['confidence_level']:g}", ""]
    header = f"{'version':>7} {'role':>7} {'requests':>8} {'errors':>16}"
    header += "".join(f" {k:>24}" for k in ("mean ms", "p50 ms", "p95 ms", "p99 ms"))
    lines.append(header)
    for v in doc["versions"]:
        rate = v["error_rate"]
        errors = f"{rate['value']:.2%} ≤{rate['high']:.2%}" if rate else "-"
        row = f"{v['version']:>7} {v['role']:>7} {v['requests']:>8} {errors:>16}"
        for key in ("mean", "p50", "p95", "p99"):
            row += f" {_interval(v['latency_ms'][key]):>24}"
        lines.append(row)
    lines.append("  (intervals: n = normal approximation, b = bootstrap; errors: Wilson bound)")
    for c in doc["candidates"]:
        lines += ["", f"{c['role']} version {c['version']} vs stable {c['baseline']}:"]
        for name, test in c["tests"].items():
            if not test:
                lines.append(f"  {name:<24} not run yet: too few requests")
                continue
            lines.append(
                f"  {name:<24} {test['name']:<18} stat {test['statistic']:>9.3f}  "
                f"p(worse) {test['p_value']:.3g}  p(two-sided) {test['p_two_sided']:.3g}"
            )
        diff = c["latency_difference_ms"]
        if diff:
            lines.append(f"  mean latency difference  {_interval(diff)} ms")
        pairs = doc["shadow_comparison"]
        if c["role"] == "shadow" and pairs["compared"]:
            lines.append(
                f"  same requests on both     {pairs['compared']} of {pairs['mirrored']} mirrored: "
                f"stable {pairs['primary_ms_mean']:.2f} ms, shadow {pairs['shadow_ms_mean']:.2f} "
                f"ms; shadow errors {pairs['shadow_errors']}"
            )
        for output, figures in (c["agreement"] or {}).items():
            text = ", ".join(
                f"{k} {f['mean']:.4f} (min {f['min']:.4f})" for k, f in figures.items()
            )
            lines.append(f"  output {output}: {text}")
        lines.append(f"  recommendation: {c['recommendation'].upper()}")
        lines += [f"    - {reason}" for reason in c["reasons"]]
    if doc["events"]:
        lines += ["", "events:"]
        lines += [f"  {e['action']}: {e['reason']} -> {e['policy']}" for e in doc["events"]]
    return "\n".join(lines)


def _interval(i: dict | None) -> str:
    if not i:
        return "-"
    return f"{i['value']:.2f} [{i['low']:.2f}, {i['high']:.2f}]{i['method'][0]}"
