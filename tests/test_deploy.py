"""deploy/: the Kubernetes manifests validated offline against the Kubernetes schemas (kubernetes-validate, strict),
the KServe InferenceService's pod validated the same way, the pieces agreeing with each other (names, ports,
paths, the image), and the in-pod TorchServe config served by a real TorchServe with the manifests' own probe
command. nginx and a cluster cannot run here: the proxy's template is checked for what it must guard."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from handlers.serving import server as tsctl
from tests.conftest import port_shift

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.default_profile  # kubernetes-validate is installed in the default venv only

DEPLOY = REPO / "deploy"
SHARED = DEPLOY / "k8s" / "shared"
KUBERNETES_VERSION = "1.33"


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """What ``kubectl kustomize DIRECTORY`` renders for the features deploy/ uses (resources, directories of
    them, and configMapGenerator without name hashes), so the suite needs no kubectl."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(spec) <= {"apiVersion", "kind", "resources", "generatorOptions", "configMapGenerator"}, spec
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = (directory / resource).resolve()
        objects += kustomize(path) if path.is_dir() else list(yaml.safe_load_all(path.read_text()))
    options = spec.get("generatorOptions", {})
    for generator in spec.get("configMapGenerator", []):
        assert options.get("disableNameSuffixHash"), "KServe's resource cannot follow hashed names"
        data = {}
        for entry in generator["files"]:
            key, _, file = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
            data[key] = (directory / file).read_text()
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": generator["name"], "labels": options.get("labels", {})}, "data": data})
    return objects


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = [obj["kind"] for obj in objects if obj["kind"] != "ConfigMap"]
    assert len(kinds) == len(set(kinds)), kinds
    return {obj["kind"]: obj for obj in objects if obj["kind"] != "ConfigMap"} | \
        {f"ConfigMap/{obj['metadata']['name']}": obj for obj in objects if obj["kind"] == "ConfigMap"}


@pytest.fixture(scope="module")
def cluster() -> dict[str, dict[str, Any]]:
    return by_kind(kustomize(DEPLOY / "k8s"))


@pytest.fixture(scope="module")
def kserve() -> dict[str, dict[str, Any]]:
    return by_kind(kustomize(DEPLOY / "kserve"))


def validate(obj: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_every_manifest_validates_against_the_kubernetes_schemas(cluster):
    assert set(cluster) == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                            "PersistentVolumeClaim", "ConfigMap/pt2-handlers-config", "ConfigMap/pt2-handlers-proxy"}
    for obj in [*cluster.values(), yaml.safe_load((DEPLOY / "k8s" / "secret.example.yaml").read_text())]:
        validate(obj)


def test_a_broken_manifest_is_caught():
    """The validator is strict: a misspelt field fails (so the test above proves something)."""
    import kubernetes_validate

    deployment = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProbes"):
        validate(deployment)


def test_the_pieces_agree(cluster):
    pod = cluster["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert cluster["Deployment"]["spec"]["selector"]["matchLabels"] == labels
    assert cluster["Service"]["spec"]["selector"] == labels
    assert cluster["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    target = cluster["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", cluster["Deployment"]["metadata"]["name"])
    containers = {container["name"]: container for container in pod["spec"]["containers"]}
    ports = {port["name"] for container in containers.values() for port in container.get("ports", [])}
    assert {port["targetPort"] for port in cluster["Service"]["spec"]["ports"]} <= ports
    assert "ports" not in containers["torchserve"], "TorchServe is reached through the auth proxy only"
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    for container in containers.values():
        assert {mount["name"] for mount in container.get("volumeMounts", [])} <= set(volumes)
    assert f"ConfigMap/{volumes['config']['configMap']['name']}" in cluster
    assert f"ConfigMap/{volumes['proxy-template']['configMap']['name']}" in cluster
    claim = volumes["compile-cache"]["persistentVolumeClaim"]["claimName"]
    assert claim == cluster["PersistentVolumeClaim"]["metadata"]["name"]
    secret = yaml.safe_load((DEPLOY / "k8s" / "secret.example.yaml").read_text())
    token = containers["auth-proxy"]["env"][0]["valueFrom"]["secretKeyRef"]
    assert (token["name"], token["key"]) == (secret["metadata"]["name"], "token")
    env = {item["name"]: item.get("value") for item in containers["torchserve"]["env"]}
    mounts = {mount["name"]: mount["mountPath"] for mount in containers["torchserve"]["volumeMounts"]}
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(mounts["compile-cache"] + "/")
    model = env["MODELS"].split("=")[0]
    for probe in ("startupProbe", "readinessProbe"):
        command = containers["torchserve"][probe]["exec"]["command"]
        assert command[-2:] == ["ready", model] and f"{mounts['config']}/config.properties" in command
    # sized to an AOT archive's start (seconds), yet waiting out a cold compile: startupTimeout, 900 s
    startup = containers["torchserve"]["startupProbe"]
    assert startup["periodSeconds"] <= 2 and startup["periodSeconds"] * startup["failureThreshold"] >= 900


def test_the_dockerfile_builds_what_the_manifests_run(cluster):
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (.+) \S+$", dockerfile, re.MULTILINE):
        for path in source.split():
            assert path == "model_store/" or (REPO / path).exists(), f"COPY {path}: not in the repository"
    assert 'pip install -c constraints/default.txt "torch==2.13.0"' in dockerfile  # pinned, before the rest
    assert dockerfile.index("torch==2.13.0") < dockerfile.index('pip install -c constraints/default.txt ".[openvino]"')
    assert dockerfile.count("-c constraints/default.txt") == 2  # every install pinned as CI's venv is
    container = next(c for c in cluster["Deployment"]["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "torchserve")
    assert f"USER {container['securityContext']['runAsUser']}" in dockerfile
    assert "--ts-config /etc/pt2-handlers/config.properties" in dockerfile
    assert "WORKDIR /var/run/torchserve" in dockerfile  # --run-dir of the probes: where key_file/logs go
    assert "COPY handlers/ handlers/" in dockerfile  # the probes' python -m handlers, from /opt/pt2-handlers
    assert "ENV TORCHINDUCTOR_CACHE_DIR=/var/cache/pt2-handlers/inductor" in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".venv-ipex", ".cache", ".git"} <= set(ignored)  # GBs that must not go into the build context
    assert "**/key_file.json" in ignored and "model_store" not in ignored


def test_the_kserve_inference_service_runs_the_same_pod(cluster, kserve):
    service = kserve["InferenceService"]
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert kserve["PersistentVolumeClaim"] == cluster["PersistentVolumeClaim"]
    predictor = dict(service["spec"]["predictor"])
    assert predictor.pop("minReplicas") >= 2 and predictor.pop("maxReplicas") >= predictor.get("minReplicas", 2)
    # The predictor's pod fields are a core PodSpec: validate them as one.
    validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "predictor"}, "spec": predictor})
    containers = {container["name"]: container for container in predictor["containers"]}
    assert list(containers)[0] == "kserve-container" and containers["kserve-container"]["ports"][0]["containerPort"]
    deployment = {c["name"]: c for c in cluster["Deployment"]["spec"]["template"]["spec"]["containers"]}
    for key in ("image", "env", "volumeMounts", "resources", "securityContext", "startupProbe"):
        assert containers["torchserve"][key] == deployment["torchserve"][key], key
    assert containers["kserve-container"]["image"] == deployment["auth-proxy"]["image"]
    assert containers["kserve-container"]["env"] == deployment["auth-proxy"]["env"]


def test_every_pod_is_guaranteed_with_whole_cpus_for_the_worker(cluster, kserve):
    """requests == limits in every container (Guaranteed QoS), and whole CPUs for TorchServe, so the kubelet's
    static CPU manager can give the worker cores of its own: a shared core stalls its OpenMP kernels."""
    pods = {"Deployment": cluster["Deployment"]["spec"]["template"]["spec"],
            "InferenceService": kserve["InferenceService"]["spec"]["predictor"]}
    for kind, pod in pods.items():
        for container in pod["containers"]:
            resources = container.get("resources", {})
            assert resources.get("requests") == resources.get("limits") and {"cpu", "memory"} <= set(
                resources.get("limits", {})), (kind, container["name"], resources)
            if container["name"] == "torchserve":
                assert str(resources["limits"]["cpu"]).isdigit(), (kind, resources)


def rendered_proxy(token: str) -> str:
    """The template as nginx's image renders it: only ${API_TOKEN} substituted (NGINX_ENVSUBST_FILTER)."""
    return (SHARED / "nginx.conf.template").read_text().replace("${API_TOKEN}", token)


def proxy_routes(config: str) -> dict[tuple[str, str], str]:
    """(listen port, location) -> the location's directives, from the rendered nginx config (quoted strings, which
    may hold braces, and comments blanked first)."""
    plain = re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", "''", re.sub(r"#[^\n]*", "", config))
    routes = {}
    for server in re.findall(r"server \{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}", plain):
        port = re.search(r"listen (\d+);", server)[1]
        for path, body in re.findall(r"location ([^{]+)\{((?:[^{}]|\{[^{}]*\})*)\}", server):
            routes[(port, path.strip())] = body
    return routes


def test_the_proxy_checks_the_token_on_every_inference_route():
    config = rendered_proxy("abc123")
    assert '"Bearer abc123" 1;' in config and "${" not in config
    props = tsctl.read_properties(SHARED / "config.properties")
    port = {name: props[f"{name}_address"].rsplit(":", 1)[1] for name in ("inference", "management", "metrics")}
    routes = proxy_routes(config)
    guarded = {route for route, body in routes.items() if "if ($pt2_token_ok = 0)" in body}
    forwarded = {route: body for route, body in routes.items() if "proxy_pass" in body or "grpc_pass" in body}
    # Every forwarding route is guarded, except the liveness ping and the metrics (neither carries a secret).
    assert set(forwarded) - guarded == {("8080", "= /ping"), ("9090", "= /metrics")}, (forwarded, guarded)
    assert f"http://127.0.0.1:{port['inference']};" in forwarded[("8080", "/predictions/")]
    assert f"http://127.0.0.1:{port['inference']};" in forwarded[("8080", "/v2/")]
    assert f"grpc://127.0.0.1:{props['grpc_inference_port']};" in forwarded[("7070", "/")]
    assert f"http://127.0.0.1:{port['metrics']};" in forwarded[("9090", "= /metrics")]
    assert f":{port['management']}" not in config, "the management API never leaves the pod"


def nginx_errors(config: str, tmp_path: Path) -> list[str]:
    """What crossplane (nginx's config grammar and directive table, offline) finds wrong with ``config`` as the
    image includes it: inside the http block."""
    import crossplane

    path = tmp_path / "nginx.conf"
    path.write_text("events {}\nhttp {\n" + config + "\n}\n")
    return [error["error"] for error in crossplane.parse(str(path))["errors"]]


def test_the_proxy_config_parses_as_nginx(tmp_path):
    config = rendered_proxy("abc123")
    assert nginx_errors(config, tmp_path) == []
    broken = config.replace("proxy_read_timeout 300s;", "proxy_read_timeout;", 1)
    assert any("invalid number of arguments" in error for error in nginx_errors(broken, tmp_path))


def test_the_in_pod_config_keeps_torchserve_on_loopback():
    props = tsctl.read_properties(SHARED / "config.properties")
    addresses = [value for key, value in props.items() if key.endswith("_address")]
    assert len(addresses) == 5 and all(a in ("127.0.0.1", "http://127.0.0.1") or a.startswith("http://127.0.0.1:")
                                       for a in addresses), addresses
    assert props["disable_token_authorization"] == "true" and props["enable_model_api"] == "false"
    proxy_ports = set(re.findall(r"listen (\d+);", rendered_proxy("t")))
    ts_ports = {value.rsplit(":", 1)[1] for value in addresses if ":" in value.removeprefix("http://")}
    ts_ports |= {props["grpc_inference_port"], props["grpc_management_port"]}
    assert proxy_ports == {"8080", "7070", "9090"} and not proxy_ports & ts_ports  # one network namespace


@pytest.mark.integration
def test_the_in_pod_config_serves_and_the_manifest_probe_says_ready(tmp_path, model_store, cluster):
    """TorchServe with the pod's config (ports shifted, paths pointed here): the probe command from the Deployment
    says READY, v2 and REST inference answer without a token (the proxy is the door), management stays inside."""
    text = (SHARED / "config.properties").read_text()
    text = text.replace("/opt/pt2-handlers/model_store/", f"{model_store}/")
    text = text.replace("/opt/pt2-handlers/model_configs/", f"{REPO}/model_configs/")
    source = tmp_path / "config.properties"
    source.write_text(text)
    (tmp_path / "shifted").mkdir()
    config = tsctl.shifted_config(tmp_path / "shifted", port_shift(14000), source)  # clear of the other test servers
    run_dir = tmp_path / "run"
    server = tsctl.start(config, model_store, ["minilm=minilm.mar"], run_dir, timeout=900)
    try:
        pod = cluster["Deployment"]["spec"]["template"]["spec"]
        probe = next(c for c in pod["containers"] if c["name"] == "torchserve")["readinessProbe"]["exec"]["command"]
        command = [sys.executable, "-m", "handlers", "--config", str(config),
                   "--run-dir", str(run_dir), *probe[probe.index("ready"):]]
        assert probe[:5] == ["env", "PYTHONPATH=/opt/pt2-handlers", "python", "-m", "handlers"], shlex.join(probe)
        ready = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert ready.returncode == 0 and ready.stdout.strip() == "minilm: 1/1 workers READY", ready
        missing = subprocess.run([*command[:-1], "nope"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert missing.returncode == 1 and "404" in missing.stderr, missing
        assert not (run_dir / "key_file.json").exists()
        body = b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hello"]}]}'
        status, raw = server.call("POST", f"{server.inference_url}/v2/models/minilm/infer", None, body,
                                  "application/json")
        assert status == 200 and json.loads(raw)["outputs"][0]["shape"] == [1, 384], raw
        status, raw = server.call("POST", f"{server.management_url}/models?url=minilm.mar&model_name=x", None)
        assert status == 405, raw  # the model API is off: nothing is registered over HTTP in a pod
    finally:
        tsctl.stop(run_dir)
