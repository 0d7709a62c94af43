"""An elastic Kubernetes job's rendezvous store (lockstep/launch/k8s_store.py): a Service and the one
pod behind it, read back through the `kubernetes` client's models. In a rendered job:
tests/unit/launch/test_k8s.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip(
    "kubernetes", reason="the Kubernetes client is an optional dependency: pip install kubernetes"
)
from kubernetes import client  # noqa: E402

from lockstep.launch.k8s_store import build_store, store_endpoint, store_name  # noqa: E402


def as_model(obj: dict, model: str):
    """Deserialize like the client does for an API response: unknown or mistyped fields would not survive."""
    return client.ApiClient().deserialize(json.dumps(obj), model, "application/json")


def check_store(service: dict, store: dict, job: str, worker_template: dict) -> None:
    """The store's Service selects its one pod, and no worker pod; the pod (of a Job that runs it once
    and is deleted after it ends) runs `lockstep rendezvous` on the Service's port until the job's
    rendezvous closes, as lockstep's own CLI parses it, and is ready once that port listens."""
    from lockstep.cli import build_parser

    svc: client.V1Service = as_model(service, "V1Service")
    runs: client.V1Job = as_model(store, "V1Job")
    assert svc.metadata.name == runs.metadata.name == f"{job}-rendezvous"
    assert runs.spec.backoff_limit == 0 and runs.spec.ttl_seconds_after_finished == 600
    assert runs.spec.template.spec.restart_policy == "Never"
    selector, pod_labels = svc.spec.selector, runs.spec.template.metadata.labels
    assert selector.items() <= pod_labels.items()
    assert not selector.items() <= worker_template["metadata"]["labels"].items()
    (port,) = svc.spec.ports
    (c,) = runs.spec.template.spec.containers
    assert port.port == port.target_port == c.ports[0].container_port == 29400
    assert c.readiness_probe.tcp_socket.port == 29400
    assert c.command[:3] == ["python", "-m", "lockstep"]
    args = build_parser()[0].parse_args(c.command[3:])
    assert (args.command, args.host, args.port, args.until_closed) == (
        "rendezvous",
        "0.0.0.0",
        29400,
        job,
    )
    # Guaranteed: requests equal limits
    assert c.resources.requests == c.resources.limits == {"cpu": "250m", "memory": "1Gi"}


def test_the_store_is_a_service_and_one_pod_running_lockstep_rendezvous():
    api = client.ApiClient()
    service, store = (api.sanitize_for_serialization(o) for o in build_store("gpt", "ml", "r:1"))
    assert store_name("gpt") == "gpt-rendezvous" and store_endpoint("gpt") == "gpt-rendezvous:29400"
    assert service["metadata"]["namespace"] == store["metadata"]["namespace"] == "ml"
    assert store["spec"]["template"]["spec"]["containers"][0]["image"] == "r:1"
    worker = {"metadata": {"labels": {"app.kubernetes.io/name": "lockstep", "lockstep/job": "gpt"}}}
    check_store(service, store, "gpt", worker)
