"""deploy/grafana and deploy/prometheus: every PromQL expression parses (Prometheus' own
parser, `promtool`), names only metrics a real bitserve exports, and the alert rules fire
on the series they should (`promtool test rules`).

promtool comes from Debian's `prometheus` package, installed here when missing and
root; without it the PromQL checks skip and the structural ones still run. No Grafana can
run here and Grafana publishes its dashboard model as CUE and as the TypeScript types
generated from it (npm `@grafana/schema`), not as a JSON schema: the slow test has `tsc`
type-check the dashboard against those types (npm and its registry needed); the fast one
checks the model's rules by hand (ids, grid, datasources, targets).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "bitserve-dashboard.json"
GRAFANA_SCHEMA, TYPESCRIPT = "13.2.3", "5"  # npm @grafana/schema (Grafana 13's model), tsc
ALERTS = ROOT / "deploy" / "prometheus" / "bitserve-alerts.yaml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "bitserve-alerts-test.yaml"
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$model": ".*"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
        for step in (["apt-get", "update", "-q"], install):
            subprocess.run(step, capture_output=True, timeout=900, check=False)
        found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed and cannot be (apt-get install prometheus)")
    return found


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    out = []
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            out.append(expr)
    return out


def alert_rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def test_alert_rules_pass_promtool(promtool):
    check = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(
        [promtool, "test", "rules", ALERT_TESTS.name],
        cwd=ALERT_TESTS.parent,
        capture_output=True,
        text=True,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_every_dashboard_query_parses_as_promql(promtool, tmp_path):
    """Each panel's query, as a recording rule: promtool parses it with Prometheus' parser."""
    rules = {"groups": [{"name": "dashboard", "rules": []}]}
    for i, expr in enumerate(dashboard_exprs()):
        rules["groups"][0]["rules"].append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    check = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_dashboard_follows_grafanas_model():
    doc = dashboard()
    for key in ("title", "uid", "schemaVersion", "panels", "templating", "time"):
        assert key in doc, key
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = doc["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        assert p["type"] in ("timeseries", "stat"), p["title"]
        assert p["title"] and p["description"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        cell = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & cell, f"panel {p['title']!r} overlaps another"
        cells |= cell
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs)
        for t in p["targets"]:
            assert t["expr"] and t["legendFormat"]
            assert t["datasource"]["uid"] == "${datasource}"


def test_alert_rules_are_complete():
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("page", "warn", "info"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["expr"].strip()


def _exported(url: str) -> set[str]:
    """Every sample name a real server's /metrics has or declares."""
    names = set()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
    return names


def test_dashboard_and_alerts_name_only_exported_metrics(default_server):
    exported = _exported(default_server.url)
    exprs = dashboard_exprs() + [r["expr"] for r in alert_rules()]
    named = set()
    for expr in exprs:
        without_labels = re.sub(r"\{[^}]*\}", "", expr)
        named.update(re.findall(r"\bbitserve_[a-z0-9_]+\b", without_labels))
    assert named, "no metric names found"
    missing = sorted(named - exported)
    assert not missing, f"not exported by bitserve: {missing}"
    # and every figure the console charts is on the dashboard too
    for name in (
        "bitserve_request_duration_seconds_bucket",
        "bitserve_llm_time_to_first_token_seconds_bucket",
        "bitserve_llm_kv_cache_usage_perc",
        "bitserve_queue_depth",
        "bitserve_batch_size_sum",
        "bitserve_llm_generation_tokens_total",
    ):
        assert name in named, name


@pytest.mark.slow
def test_dashboard_type_checks_against_grafanas_schema(tmp_path):
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: cannot fetch @grafana/schema")
    (tmp_path / "package.json").write_text('{"private": true}')
    packages = [f"typescript@{TYPESCRIPT}", f"@grafana/schema@{GRAFANA_SCHEMA}"]
    install = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--silent", *packages],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if install.returncode != 0:
        pytest.skip(f"npm could not install {packages}: {install.stderr[-300:]}")
    doc = dashboard()
    doc.pop("__inputs")  # the import dialog's placeholders: not part of the model
    (tmp_path / "check.ts").write_text(
        'import type { Dashboard } from "@grafana/schema";\n'
        f"const dashboard: Dashboard = {json.dumps(doc, indent=1)};\n"
        "export default dashboard;\n"
    )
    tsc = tmp_path / "node_modules" / ".bin" / "tsc"
    options = ["--noEmit", "--strict", "--skipLibCheck", "--target", "es2020"]
    options += ["--module", "esnext", "--moduleResolution", "bundler"]
    check = subprocess.run(
        [tsc, *options, "check.ts"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_consoles_quantiles_are_prometheus_histogram_quantile(promtool, tmp_path):
    """The console's p50/p99 (metrics.js, run by node) against Prometheus' own
    histogram_quantile over the same two scrapes of two models' buckets."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: cannot run the console's metrics.js")
    bounds = ["0.005", "0.025", "0.1", "0.5", "+Inf"]
    before = {"a": [3, 5, 9, 9, 10], "b": [0, 0, 4, 6, 6]}
    after = {"a": [3, 25, 79, 90, 95], "b": [1, 2, 30, 60, 61]}
    quantiles = [0.01, 0.2, 0.5, 0.9, 0.99, 0.999]

    def scrape(counts: dict) -> str:
        return "".join(
            f'h_bucket{{le="{le}",model="{m}"}} {c}\n'
            for m, row in counts.items()
            for le, c in zip(bounds, row, strict=True)
        )

    metrics_js = ROOT / "bitserve" / "server" / "console" / "metrics.js"
    script = tmp_path / "quantiles.mjs"
    script.write_text(
        f"import {{ parse, quantile }} from {json.dumps(metrics_js.as_uri())};\n"
        f"const a = parse({json.dumps(scrape(before))}), b = parse({json.dumps(scrape(after))});\n"
        f"console.log(JSON.stringify({quantiles}.map(q => quantile(a, b, 'h', () => true, q))));\n"
    )
    ours = subprocess.run([node, script], capture_output=True, text=True, check=True).stdout
    series = [
        {"series": f'h_bucket{{le="{le}",model="{m}"}}', "values": f"{before[m][i]} {after[m][i]}"}
        for m in before
        for i, le in enumerate(bounds)
    ]
    tests = [
        {
            "expr": f"histogram_quantile({q}, sum by (le) (h_bucket - h_bucket offset 1m))",
            "eval_time": "1m",
            "exp_samples": [{"labels": "{}", "value": value}],
        }
        for q, value in zip(quantiles, json.loads(ours), strict=True)
    ]
    path = tmp_path / "quantiles.yaml"
    doc = {"tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}]}
    path.write_text(yaml.safe_dump(doc))
    check = subprocess.run([promtool, "test", "rules", path], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
