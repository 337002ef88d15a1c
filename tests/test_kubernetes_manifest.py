"""examples/kubernetes/serve.yaml is valid for the Kubernetes API (strict: an unknown field fails)
and in step with serve: probes on /health at the port serve listens on, a grace period longer than
serve's stop, a startup window as long as serve's, and a config serve accepts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Union

import pytest

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate is not installed (it is in the test extra: pip install '.[test]')",
)
import yaml  # noqa: E402 - kubernetes-validate depends on PyYAML

from kvcached.serve.config import parse_config  # noqa: E402
from kvcached.serve.config_limits import load_yaml  # noqa: E402
from kvcached.serve.spec import DEFAULT_STOP_TIMEOUT_S  # noqa: E402

MANIFEST = Path(__file__).resolve().parent.parent / "examples" / "kubernetes" / "serve.yaml"
# A release the large clouds still run, and the newest whose schema the installed package ships.
KUBERNETES_VERSIONS = ("1.33", kubernetes_validate.latest_version())


def documents() -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(MANIFEST.read_text()) if document]


def only(kind: str) -> dict[str, Any]:
    (found,) = [document for document in documents() if document["kind"] == kind]
    return found


def serve_container() -> dict[str, Any]:
    (container,) = only("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def serve_config_text() -> str:
    """The serve.yaml the Deployment's command reads, from the ConfigMap its volume mounts."""
    pod = only("Deployment")["spec"]["template"]["spec"]
    config_path = Path(serve_container()["command"][-1])
    (mount,) = [m for m in serve_container()["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = only("ConfigMap")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"], "the volume mounts the ConfigMap"
    return config_map["data"][config_path.name]


def container_port(port: Union[int, str]) -> int:
    """A probe's or a Service's port as a number: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    (named,) = [p for p in serve_container()["ports"] if p.get("name") == port]
    return named["containerPort"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_document_is_valid_for_the_kubernetes_api(version):
    assert [document["kind"] for document in documents()] == ["ConfigMap", "Deployment", "Service"]
    for document in documents():
        kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda container: container.update(readinessprobe=container.pop("readinessProbe")),  # misspelt
        lambda container: container["ports"][0].update(containerPort="8000"),  # a string for a number
        lambda container: container["startupProbe"]["httpGet"].update(url="/health"),  # not a field
    ],
    ids=["misspelt-field", "wrong-type", "unknown-field"],
)
def test_a_broken_manifest_fails_validation(break_it):
    """The check is strict: what a cluster would refuse (or silently ignore) fails here."""
    deployment = copy.deepcopy(only("Deployment"))
    break_it(deployment["spec"]["template"]["spec"]["containers"][0])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_config_it_mounts_is_one_serve_accepts_on_every_address_of_the_pod():
    text = serve_config_text()
    assert "listen: 0.0.0.0:8000" in text
    config = parse_config(load_yaml(text))
    assert (config.host, config.port) == ("0.0.0.0", 8000)
    assert config.device == "cuda:0" and len(config.models) == 1, "one model on the pod's one GPU"
    assert serve_container()["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_probes_ask_serve_health_on_the_port_it_listens_on():
    config = parse_config(load_yaml(serve_config_text()))
    container = serve_container()
    assert [port["containerPort"] for port in container["ports"]] == [config.port]
    for probe in ("readinessProbe", "startupProbe"):
        check = container[probe]["httpGet"]
        assert (check["path"], container_port(check["port"])) == ("/health", config.port), probe
    # /health is 503 while serve restarts a crashed engine: a liveness probe on it would kill the pod.
    assert "livenessProbe" not in container
    (service_port,) = only("Service")["spec"]["ports"]
    assert container_port(service_port["targetPort"]) == config.port


def test_the_startup_probe_waits_as_long_as_serve_does():
    config = parse_config(load_yaml(serve_config_text()))
    probe = serve_container()["startupProbe"]
    window_s = probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    assert window_s >= config.startup_timeout_s, "the kubelet would kill a serve still loading its models"


def test_the_grace_period_outlasts_serves_stop():
    config = parse_config(load_yaml(serve_config_text()))
    grace_s = only("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s > max(config.stop_timeout_s, DEFAULT_STOP_TIMEOUT_S), "engines would be killed mid-stop"


def test_the_service_and_the_deployment_select_the_pods():
    deployment = only("Deployment")["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert deployment["selector"]["matchLabels"].items() <= labels.items()
    assert only("Service")["spec"]["selector"].items() <= labels.items()


def test_the_registry_lives_in_the_pods_own_memory():
    """One registry, and so one budget, per pod: /dev/shm is a memory volume of the pod."""
    pod = only("Deployment")["spec"]["template"]["spec"]
    registry_dir = {e["name"]: e["value"] for e in serve_container()["env"]}["KVCACHED_REGISTRY_DIR"]
    (mount,) = [m for m in serve_container()["volumeMounts"] if m["mountPath"] == registry_dir]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"] == {"medium": "Memory"}
