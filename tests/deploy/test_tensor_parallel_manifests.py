"""deploy/leaderworkerset.yaml (a model sharded over two pods) and deploy/kserve.yaml (a
ServingRuntime + InferenceService). LWS and KServe are CRDs whose schemas no offline
package here ships, so: every pod template and container they hold is validated strictly
against the Kubernetes schemas (kubernetes-validate, offline) as a Pod, the plain objects
(Services) as themselves, and the CRD fields that matter are checked here by name; the
flags go through genserve's own parsers."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import DEPLOY, serve_args

K8S = "1.29.0"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _validate_pod(spec: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
    import kubernetes_validate

    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "check", **(metadata or {})}, "spec": spec}
    kubernetes_validate.validate(pod, K8S, strict=True)


def _worker_args(argv: list[str]) -> argparse.Namespace:
    from service.cli import _worker_parser

    parser = argparse.ArgumentParser(prog="genserve")
    sub = parser.add_subparsers(dest="command", required=True)
    _worker_parser(sub)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def lws() -> dict[str, Any]:
    return _kind(_docs("leaderworkerset.yaml"), "LeaderWorkerSet")


def test_the_leaderworkerset_pod_templates_are_valid_pods(lws):
    template = lws["spec"]["leaderWorkerTemplate"]
    for part in ("leaderTemplate", "workerTemplate"):
        _validate_pod(template[part]["spec"], template[part].get("metadata"))


def test_the_leaderworkerset_shards_one_model_over_its_group(lws, monkeypatch):
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert set(template) == {"size", "restartPolicy", "leaderTemplate", "workerTemplate"}
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"  # a group lives whole
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    serve = serve_args([str(a) for a in leader["args"]])
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")  # LWS sets it in the worker pod
    work = _worker_args([str(a) for a in worker["args"]])
    assert work.tp_node_rank == 1
    assert serve.tp_nnodes == work.tp_nnodes == template["size"]
    assert serve.tensor_parallel_size == work.tensor_parallel_size
    assert serve.device == work.device == "cuda"
    gpus = [int(c["resources"]["limits"]["nvidia.com/gpu"]) for c in (leader, worker)]
    assert sum(gpus) == serve.tensor_parallel_size  # one rank per GPU
    for c in (leader, worker):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["MASTER_PORT"] == "29500"
    assert {p["name"]: p["containerPort"] for p in leader["ports"]} == {
        "grpc": serve.port, "metrics": serve.metrics_port, "rendezvous": 29500}
    assert "ports" not in worker and "readinessProbe" not in worker  # serves no RPC
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe]["grpc"]["port"] == serve.port


def test_the_leaderworkerset_service_reaches_leaders_only():
    import kubernetes_validate

    service = _kind(_docs("leaderworkerset.yaml"), "Service")
    kubernetes_validate.validate(service, K8S, strict=True)
    assert service["spec"]["selector"] == {
        "leaderworkerset.sigs.k8s.io/name": "genserve-tp",
        "leaderworkerset.sigs.k8s.io/worker-index": "0"}


@pytest.fixture(scope="module")
def kserve() -> list[dict[str, Any]]:
    return _docs("kserve.yaml")


def test_the_kserve_runtime_serves_grpc_with_probes_and_metrics(kserve):
    runtime = _kind(kserve, "ServingRuntime")
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    spec = runtime["spec"]
    (container,) = spec["containers"]
    _validate_pod({"containers": spec["containers"]})  # a ServingRuntime's are Containers
    assert container["name"] == "kserve-container"  # KServe's name for the model server
    args = serve_args([str(a) for a in container["args"]])
    assert args.model == "/mnt/models"  # where the storage initializer puts storageUri
    (port,) = container["ports"]
    assert port == {"name": "h2c", "containerPort": args.port, "protocol": "TCP"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == args.port
    assert spec["annotations"]["prometheus.kserve.io/port"] == str(args.metrics_port)
    assert spec["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    assert spec["protocolVersions"] == ["grpc-v1"]


def test_the_inferenceservice_uses_the_runtime(kserve):
    runtime = _kind(kserve, "ServingRuntime")
    isvc = _kind(kserve, "InferenceService")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    assert model["storageUri"].split("://")[0] in ("pvc", "s3", "gs", "hf", "https")
    notes = isvc["metadata"]["annotations"]
    assert notes["serving.kserve.io/enable-prometheus-scraping"] == "true"
    assert notes["serving.kserve.io/deploymentMode"] == "RawDeployment"


def test_a_bad_container_field_in_a_template_would_fail(lws):
    import kubernetes_validate

    spec = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    bad = {**spec, "containers": [{**spec["containers"][0], "argz": ["serve"]}]}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_pod(bad)
