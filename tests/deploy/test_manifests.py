"""deploy/kubernetes.yaml and deploy/hpa.yaml: valid against the Kubernetes schemas
(offline, kubernetes-validate) and consistent with what the server does."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import DEPLOY, REPO, serve_args, serve_defaults

K8S_VERSIONS = ("1.29.0", "latest")  # native gRPC probes are GA since 1.27


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return _docs("kubernetes.yaml")


@pytest.fixture(scope="module")
def deployment(docs) -> dict[str, Any]:
    return _one(docs, "Deployment", "genserve")


@pytest.fixture(scope="module")
def pod(deployment) -> dict[str, Any]:
    return deployment["spec"]["template"]


@pytest.fixture(scope="module")
def container(pod) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def args(container):
    """The container's args, parsed by `genserve serve`'s own parser (the image's
    entrypoint is `genserve`)."""
    assert "command" not in container  # the image's ENTRYPOINT stays
    assert container["args"][0] == "serve"
    return serve_args([str(a) for a in container["args"]])


def _port(container, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ["kubernetes.yaml", "hpa.yaml", "kubernetes-tls.yaml"])
def test_valid_against_the_kubernetes_schemas(name, version):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    v = latest_version() if version == "latest" else version
    docs = _docs(name)
    assert docs
    for doc in docs:
        # strict: an unknown or misspelt field fails too
        kubernetes_validate.validate(doc, v, strict=True)


def test_a_misspelt_field_would_fail():
    """The validator really checks: a probe field misspelt is an error."""
    import kubernetes_validate

    doc = _one(_docs("kubernetes.yaml"), "Deployment")
    probe = doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["grpc"]["prot"] = probe["grpc"].pop("port")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, "1.29.0", strict=True)


def test_the_manifest_has_the_parts(docs):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [("Deployment", "genserve"), ("PodDisruptionBudget", "genserve"),
                     ("Service", "genserve-headless"), ("Service", "genserve-metrics")]


def test_ports_match_the_cli(container, args):
    defaults = serve_defaults()
    assert args.port == defaults.port == _port(container, "grpc") == 50051
    assert args.metrics_port == defaults.metrics_port == _port(container, "metrics") == 9400
    assert args.host == "0.0.0.0"  # reachable from the kubelet and other pods


def test_probes_are_grpc_on_the_server_port(container, args):
    from service.server import SERVICE_NAME

    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        assert set(probe) & {"httpGet", "tcpSocket", "exec"} == set(), kind
        assert probe["grpc"]["port"] == args.port, kind
        # the server sets health for exactly these two names (service/server.py)
        assert probe["grpc"].get("service", "") in ("", SERVICE_NAME), kind
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60  # model load
    live = container["livenessProbe"]
    # liveness never gives up on a pod within the drain grace (health is NOT_SERVING then)
    assert live["periodSeconds"] * live["failureThreshold"] >= args.drain_grace_seconds


def test_termination_grace_exceeds_the_prestop_sleep_and_the_drain_grace(pod, args):
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    command = pod["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert grace > int(command[1]) + args.drain_grace_seconds
    assert "--drain-grace-seconds=30" in pod["spec"]["containers"][0]["args"]
    assert serve_defaults().drain_grace_seconds == 30


def test_headless_service_for_round_robin(docs, pod, container):
    svc = _one(docs, "Service", "genserve-headless")["spec"]
    assert svc["clusterIP"] == "None"
    labels = pod["metadata"]["labels"]
    assert svc["selector"].items() <= labels.items()
    (port,) = svc["ports"]
    assert port["targetPort"] == "grpc" and port["port"] == _port(container, "grpc")
    assert not svc.get("publishNotReadyAddresses", False)  # DNS lists ready pods only


def test_metrics_scrape(docs, pod, container, args):
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == args.metrics_port == _port(container, "metrics")
    assert ann["prometheus.io/path"] == "/metrics"
    svc = _one(docs, "Service", "genserve-metrics")["spec"]
    assert svc.get("type", "ClusterIP") == "ClusterIP" and svc.get("clusterIP") != "None"
    assert svc["selector"].items() <= pod["metadata"]["labels"].items()
    assert [p["targetPort"] for p in svc["ports"]] == ["metrics"]


def test_non_root_and_locked_down(pod, container):
    sc = pod["spec"]["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(rf"^USER {sc['runAsUser']}:{sc['runAsGroup']}$", dockerfile, re.M)
    csc = container["securityContext"]
    assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]
    if csc.get("readOnlyRootFilesystem"):
        assert "/tmp" in [m["mountPath"] for m in container["volumeMounts"]]


def test_resources(container):
    r = container["resources"]
    for part in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(r[part]), part


def test_deployment_selects_its_pods(deployment, pod, docs):
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    pdb = _one(docs, "PodDisruptionBudget")["spec"]
    assert pdb["selector"]["matchLabels"] == selector
    assert pdb["minAvailable"] < deployment["spec"]["replicas"]


def _exported_metrics() -> dict[str, str]:
    """Metric family name -> type, as a server's registry exports them (engine gauges
    included, from a stand-in EngineStats)."""
    from engine.outputs import EngineStats
    from service.metrics import Metrics

    metrics = Metrics()
    metrics.add_engine_collector(lambda: EngineStats(num_running=1, num_waiting=2,
                                                     num_requests=3, kv_blocks_total=4,
                                                     kv_blocks_used=1, num_preemptions=0),
                                 lambda: 0)
    return {m.name: m.type for m in metrics.registry.collect()}


def test_hpa_scales_the_deployment_on_the_queue_depth(deployment):
    (hpa,) = _docs("hpa.yaml")
    spec = hpa["spec"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = spec["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    (metric,) = spec["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == "genserve_waiting_sequences"
    assert _exported_metrics()[name] == "gauge"  # what the server really exports
    assert metric["pods"]["target"]["type"] == "AverageValue"


def test_readme_points_at_the_manifests():
    readme = (REPO / "README.md").read_text()
    for path in ("deploy/kubernetes.yaml", "deploy/hpa.yaml", "deploy/Dockerfile"):
        assert path in readme


def test_tls_variant_probes_a_plaintext_health_port():
    """With --tls-cert the kubelet's gRPC probe cannot reach the TLS port: every probe goes
    to --health-port, which the container exposes; the TLS files come from a Secret."""
    from service.server import SERVICE_NAME

    (deployment,) = _docs("kubernetes-tls.yaml")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = serve_args([str(a) for a in container["args"]])
    assert args.tls_cert and args.tls_key and args.health_port == _port(container, "health")
    assert args.port == _port(container, "grpc") != args.health_port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[kind]["grpc"]["port"] == args.health_port, kind
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert args.tls_cert.startswith(mounts["tls"]) and args.tls_key.startswith(mounts["tls"])
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "genserve-tls"
    assert pod["spec"]["terminationGracePeriodSeconds"] > args.drain_grace_seconds + 5
