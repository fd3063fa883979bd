"""The Kubernetes manifests in deploy/k8s, checked without a cluster.

- Core kinds (Deployment, Service, PodDisruptionBudget, ...) are validated with
  kubernetes-validate in strict mode (unknown fields fail) for the oldest and newest Kubernetes
  versions the manifests support; a planted error shows that validation does fail.
- CRD kinds (ServiceMonitor, ScaledObject, InferencePool, InferenceObjective, HTTPRoute) have no
  schema here: each has a test that says so and skips. Their references to the core objects
  (names, labels, ports, metric names) are checked instead.
- The Deployment against inferd itself: the probes' paths are routes the app serves and open
  without a key, and the grace period outlasts preStop + server.drain_seconds of the settings
  the pod really gets (its ConfigMap's inferd.toml and its INFERD_* variables).
- The overlays are rendered with `kubectl kustomize` (skipped where kubectl is missing) and
  the output validated and checked like the files.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from unittest.mock import sentinel

import kubernetes_validate
import pytest
import yaml
from aiohttp import web
from kubernetes_validate.utils import all_versions, major_minor

from inferd.api.edge import EDGE
from inferd.api.endpoints import add_endpoints
from inferd.api.gateway.gate import GATEWAY
from inferd.api.routing.registry import REGISTRY
from inferd.api.state import STATE
from inferd.api.streaming.backpressure import SLOW_CLIENTS
from inferd.api.streaming.resume import RESUMABLE
from inferd.api.telemetry.loop_lag import LOOP_LAG
from inferd.api.conversation.volatile import VOLATILE
from inferd.api.telemetry.metrics import setup_metrics
from inferd.settings.config import Settings, load_settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
# 1.30: the oldest with the kubelet's preStop `sleep` action on by default (deployment.yaml
# uses it); 1.37: the newest whose schemas the installed kubernetes-validate ships.
VERSIONS = ("1.30", "1.37")

# Why no CRD schema is validated: the registries reachable here (PyPI, npm, Debian) have no
# package with these CRDs' OpenAPI schemas (kubernetes-validate carries the core API only), and
# nothing may be fetched at test time. What they do have is generated code, named per kind.
_NO_SCHEMA = ("Checked instead: its references to the core objects (test_crd_references) and, where "
              "kubectl is present, that the overlays render")
CRDS = {  # kind -> (apiVersion, the project that publishes its CRD, what the registries have)
    "ServiceMonitor": ("monitoring.coreos.com/v1", "the Prometheus Operator",
                       "only generated code: PyPI's cloudcoil-models-prometheus-operator (pydantic models "
                       "that let unknown fields pass), npm's @kubernetes-models/prometheus-operator (compiled "
                       "JavaScript validators, which would need node and an npm install at test time)"),
    "ScaledObject": ("keda.sh/v1alpha1", "KEDA",
                     "only generated code: PyPI's cloudcoil-models-keda (lenient pydantic models), "
                     "npm's @kubernetes-models/keda (compiled JavaScript validators)"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "the Gateway API",
                  "only npm's @kubernetes-models/gateway-api (compiled JavaScript validators)"),
    "InferencePool": ("inference.networking.k8s.io/v1", "the Gateway API Inference Extension",
                      "no package at all"),
    "InferenceObjective": ("llm-d.ai/v1alpha2", "llm-d-router", "no package at all"),
}


# ------------------------------------------------------------------------------ loading


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def resource_files() -> list[Path]:
    """Every file a kustomization lists under `resources` (folders are other kustomizations)."""
    files = []
    for k in kustomizations():
        for entry in yaml.safe_load(k.read_text()).get("resources", []):
            path = (k.parent / entry).resolve()
            if path.is_file():
                files.append(path)
    return sorted(set(files))


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def file_docs() -> list[dict[str, Any]]:
    return [doc for path in resource_files() for doc in load(path)]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    return c


def validate(doc: dict[str, Any], version: str) -> None:
    """Strict schema validation of a core kind; a CRD kind or an unknown kind fails here."""
    assert doc["kind"] not in CRDS, doc["kind"]
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Each overlay as `kubectl kustomize` renders it (kubectl ships kustomize)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH (the base image's apt package kubectl brings it, with "
                    "kustomize built in): the overlays' rendering is not checked on this machine")
    out = {}
    for name in OVERLAYS:
        run = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / name)],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, f"kubectl kustomize overlays/{name}:\n{run.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(run.stdout) if doc]
    return out


# ------------------------------------------------------------------------------ the files


def test_every_manifest_is_in_a_kustomization() -> None:
    listed = set(resource_files())
    on_disk = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert on_disk == listed, {"not listed": on_disk - listed, "missing": listed - on_disk}
    for k in kustomizations():  # generators' files, components' folders
        spec = yaml.safe_load(k.read_text())
        for gen in spec.get("configMapGenerator", []):
            assert all((k.parent / f).is_file() for f in gen.get("files", [])), (k, gen)
        assert all((k.parent / c / "kustomization.yaml").is_file() for c in spec.get("components", [])), k


def test_the_supported_versions_have_schemas() -> None:
    shipped = {major_minor(v) for v in all_versions()}
    assert set(VERSIONS) <= shipped, f"kubernetes-validate {kubernetes_validate.__version__} lacks {VERSIONS}"


def core_docs() -> list[Any]:
    return [pytest.param(doc, id=f"{path.relative_to(K8S)}:{doc['kind']}")
            for path in resource_files() for doc in load(path) if doc["kind"] not in CRDS]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("doc", core_docs())
def test_core_manifests_validate_strictly(doc: dict[str, Any], version: str) -> None:
    validate(doc, version)


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_crd_schema(kind: str) -> None:
    api_version, project, packages = CRDS[kind]
    found = [d["apiVersion"] for d in file_docs() if d["kind"] == kind]
    assert found == [api_version], (kind, found)  # the kind is there, in the version named
    pytest.skip(f"{kind} ({api_version}, from {project}): schema not validated, no registry package "
                f"ships it ({packages}), and nothing is fetched at test time. {_NO_SCHEMA}")


@pytest.mark.parametrize("version", VERSIONS)
def test_a_planted_error_fails_validation(version: str) -> None:
    deployment = one(file_docs(), "Deployment")
    validate(deployment, version)
    nameless = copy.deepcopy(deployment)
    del container(nameless)["name"]
    with pytest.raises(kubernetes_validate.ValidationError, match="'name' is a required property"):
        validate(nameless, version)
    misspelt = copy.deepcopy(deployment)  # strict mode: an unknown field fails too
    container(misspelt)["readinessprobe"] = container(misspelt).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="'readinessprobe' was unexpected"):
        validate(misspelt, version)


# ------------------------------------------------------------------------------ against inferd


def served_paths() -> set[str]:
    """GET routes of the real app's route table (/metrics comes from setup_metrics, which only
    stores the models, gateway, streams, counts and state it is given: nothing is scraped here)."""
    app = web.Application()
    app[REGISTRY], app[STATE] = sentinel.models, sentinel.state
    app[GATEWAY], app[RESUMABLE], app[SLOW_CLIENTS] = sentinel.gateway, sentinel.resumable, sentinel.slow
    app[EDGE], app[LOOP_LAG], app[VOLATILE] = sentinel.edge, sentinel.loop_lag, sentinel.volatile
    add_endpoints(app)
    setup_metrics(app)
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource}


def effective_settings(deployment: dict[str, Any], toml: str, tmp_path: Path) -> Settings:
    """The settings the pod gets: its inferd.toml, then its INFERD_* variables (as inferd reads them)."""
    path = tmp_path / "inferd.toml"
    path.write_text(toml)
    env = {e["name"]: e["value"] for e in container(deployment).get("env", []) if "value" in e}
    return load_settings(path, environ=env)


def check_deployment(deployment: dict[str, Any], settings: Settings) -> None:
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    prestop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace, drain = pod["terminationGracePeriodSeconds"], settings.server.drain_seconds
    assert grace > prestop + drain, (grace, prestop, drain)
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/health"
    paths, ports = served_paths(), {p["name"] for p in c["ports"]}
    for kind, probe in probes.items():
        assert probe["path"] in paths, (kind, probe["path"], paths)
        assert probe["path"] in settings.server.open_paths, f"{kind}: kubelet sends no API key"
        assert probe["port"] in ports, (kind, probe["port"])
    assert "/metrics" in paths and "/metrics" in settings.server.open_paths  # Prometheus, the picker
    assert c["args"][:3] == ["serve", "--config", "/etc/inferd/inferd.toml"], c["args"]
    assert c["args"][c["args"].index("--port") + 1] == str(c["ports"][0]["containerPort"])


def test_the_deployment_fits_inferd(tmp_path: Path) -> None:
    deployment = one(file_docs(), "Deployment")
    toml = (K8S / "base" / "inferd.toml").read_text()
    settings = effective_settings(deployment, toml, tmp_path)
    check_deployment(deployment, settings)
    check_deployment(deployment, load_settings(REPO / "inferd.toml", environ={}))  # the repo's defaults
    # the model is on the read-only volume mounted at /srv/models; the GPU is requested
    assert settings.model.path is not None and settings.model.path.startswith("/srv/models/")
    [mount] = [m for m in container(deployment)["volumeMounts"] if m["mountPath"] == "/srv/models"]
    assert mount["readOnly"] is True
    assert container(deployment)["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_cpu_settings_load() -> None:
    settings = load_settings(K8S / "overlays/cpu/inferd.toml", environ={"INFERD_MODEL_DEVICE": "cpu"})  # (its patch)
    assert settings.model.path is None and settings.model.device == "cpu"


def check_references(docs: list[dict[str, Any]]) -> None:
    """The objects point at each other: names, label selectors, ports, metric names."""
    kinds = {d["kind"] for d in docs}
    deployment, service = one(docs, "Deployment"), one(docs, "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in container(deployment)["ports"]}
    port_numbers = {p["containerPort"] for p in container(deployment)["ports"]}

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return bool(selector) and selector.items() <= labels.items()

    assert selects(service["spec"]["selector"], pod_labels)
    assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])
    assert selects(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    if "ServiceMonitor" in kinds:
        monitor = one(docs, "ServiceMonitor")["spec"]
        assert selects(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
        assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
        assert {e["path"] for e in monitor["endpoints"]} == {"/metrics"}
    if "ScaledObject" in kinds:
        scaled = one(docs, "ScaledObject")["spec"]
        assert scaled["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]
        metrics_source = (REPO / "inferd/api/telemetry/metrics.py").read_text()
        for trigger in scaled["triggers"]:
            assert trigger["type"] == "prometheus"
            assert all(isinstance(v, str) for v in trigger["metadata"].values())  # KEDA: strings only
            query = trigger["metadata"]["query"]
            for name in re.findall(r"\binferd_\w+", query):
                assert f'"{name}"' in metrics_source, f"{name}: not a metric inferd serves"
            namespace = deployment["metadata"].get("namespace")
            if namespace:  # (set by kustomize; the queries name it by hand)
                assert f'namespace="{namespace}"' in query, query
            assert f'job="{service["metadata"]["name"]}"' in query, query
    if "InferencePool" in kinds:
        pool = one(docs, "InferencePool")
        assert selects(pool["spec"]["selector"]["matchLabels"], pod_labels)
        assert {p["number"] for p in pool["spec"]["targetPorts"]} <= port_numbers
        objective = one(docs, "InferenceObjective")["spec"]
        assert objective["poolRef"]["name"] == pool["metadata"]["name"]
        [rule] = one(docs, "HTTPRoute")["spec"]["rules"]
        assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                        "name": pool["metadata"]["name"]}]


def test_crd_references() -> None:
    check_references(file_docs())


# ------------------------------------------------------------------------------ the overlays


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                       tmp_path: Path) -> None:
    docs = rendered[overlay]
    for doc in docs:
        assert doc["metadata"].get("namespace", "inferd") == "inferd", doc["metadata"]
        if doc["kind"] not in CRDS:
            for version in VERSIONS:
                validate(doc, version)
    check_references(docs)
    deployment, config = one(docs, "Deployment"), one(docs, "ConfigMap")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config["metadata"]["name"]  # the hashed name
    assert {m["name"] for m in container(deployment)["volumeMounts"]} <= set(volumes)
    check_deployment(deployment, effective_settings(deployment, config["data"]["inferd.toml"], tmp_path))


def test_the_cpu_overlay_needs_no_gpu_and_no_crd(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    docs = rendered["cpu"]
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)
    assert not {d["kind"] for d in docs} & set(CRDS | {"PersistentVolumeClaim": None})
    deployment = one(docs, "Deployment")
    settings = effective_settings(deployment, one(docs, "ConfigMap")["data"]["inferd.toml"], tmp_path)
    assert settings.model.device == "cpu" and settings.model.path is None
    secret = one(docs, "Secret")["metadata"]["name"]
    [keys] = [e for e in container(deployment)["env"] if e["name"] == "INFERD_API_KEYS"]
    assert keys["valueFrom"]["secretKeyRef"]["name"] == secret


def test_the_gpu_overlay_has_every_component(rendered: dict[str, list[dict[str, Any]]]) -> None:
    kinds = {d["kind"] for d in rendered["gpu"]}
    assert set(CRDS) <= kinds
    assert container(one(rendered["gpu"], "Deployment"))["resources"]["limits"]["nvidia.com/gpu"] == 1
