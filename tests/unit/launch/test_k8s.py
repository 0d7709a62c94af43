"""`lockstep k8s`: manifests read back through the `kubernetes` client's models, and refused input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip(
    "kubernetes", reason="the Kubernetes client is an optional dependency: pip install kubernetes"
)
from kubernetes import client  # noqa: E402

from lockstep.config import load_config
from lockstep.errors import ConfigError
from lockstep.launch.k8s import K8sSettings  # noqa: E402
from lockstep.launch.k8s_render import render_manifests, render_yaml  # noqa: E402

from .test_k8s_store import as_model, check_store  # noqa: E402


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("train: {max_steps: 4, batch_size: 16}\ndistributed: {world_size: 16}\n")
    return path


# the PyTorchJob CRD's schema (training-operator v1.9.0), pod template cut to its type: see the file's $comment
PYTORCHJOB_SCHEMA = json.loads((Path(__file__).parent / "data" / "pytorchjob-v1.json").read_text())
TYPES = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}


def schema_errors(value, schema: dict, where: str = "") -> list[str]:
    """What the API server would refuse (wrong types, missing required fields) or silently prune (fields the
    schema does not know) in `value`, by the CRD's structural schema."""
    want = TYPES[schema["type"]] if "type" in schema else object
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        return [f"{where or '.'}: {value!r} is not {schema['type']}"]
    if schema.get("format") == "int32" and not -(2**31) <= value < 2**31:
        return [f"{where}: {value} is out of int32"]
    errors = [f"{where}.{key}: required" for key in schema.get("required", []) if key not in value]
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                errors += schema_errors(item, props[key], f"{where}.{key}")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, f"{where}.{key}")
            elif props is not None:
                errors.append(f"{where}.{key}: not in the schema (the API server would drop it)")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    return errors


def check_pytorchjob(job: dict) -> None:
    """The CRD's schema, and the rules of the operator's admission webhook (pytorchjob_webhook.go, v1.9.0)."""
    assert schema_errors(job, PYTORCHJOB_SCHEMA) == []
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) <= {"Master", "Worker"}
    if "elasticPolicy" in job["spec"]:
        assert "Worker" in replicas  # "must be configured if elastic policy is used"
    for role, spec in replicas.items():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        assert spec["replicas"] == 1 if role == "Master" else spec["replicas"] >= 1
        template: client.V1PodTemplateSpec = as_model(spec["template"], "V1PodTemplateSpec")
        assert any(c.name == "pytorch" and c.image for c in template.spec.containers)


def test_indexed_job_and_headless_service(config):
    s = K8sSettings(
        image="reg/lockstep:1",
        kind="indexed",
        name="gpt",
        nodes=2,
        gpus_per_node=8,
        cpu="32",
        memory="200Gi",
        volume_claim="runs",
        extra_env={"NCCL_DEBUG": "WARN"},
    )
    docs = list(yaml.safe_load_all(render_yaml(s, load_config(config))))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Job"]
    cm = as_model(docs[0], "V1ConfigMap")
    assert yaml.safe_load(cm.data["config.yaml"])["distributed"]["world_size"] == 16
    svc: client.V1Service = as_model(docs[1], "V1Service")
    assert (
        svc.spec.cluster_ip == "None"
        and svc.metadata.name == "gpt"
        and svc.spec.ports[0].port == 29500
    )
    job: client.V1Job = as_model(docs[2], "V1Job")
    assert (
        job.spec.completion_mode == "Indexed" and job.spec.completions == job.spec.parallelism == 2
    )
    pod = job.spec.template.spec
    assert pod.subdomain == "gpt" and pod.restart_policy == "Never"
    # the service finds the pods
    assert svc.spec.selector.items() <= job.spec.template.metadata.labels.items()
    (c,) = pod.containers
    args = c.command
    # pod 0 via the service
    assert args[0] == "torchrun" and args[args.index("--master-addr") + 1] == "gpt-0.gpt"
    assert args[args.index("--node-rank") + 1] == "$(NODE_RANK)"
    assert (
        args[args.index("--nnodes") + 1] == "2" and args[args.index("--nproc-per-node") + 1] == "8"
    )
    assert args[-5:] == ["-m", "lockstep", "train", "--config", "/etc/lockstep/config.yaml"]
    env = {e.name: e for e in c.env}
    assert "job-completion-index" in env["NODE_RANK"].value_from.field_ref.field_path
    assert env["OMP_NUM_THREADS"].value == "4" and env["NCCL_DEBUG"].value == "WARN"
    assert c.resources.limits == {"memory": "200Gi", "nvidia.com/gpu": "8"}
    assert c.resources.requests == {"cpu": "32", "memory": "200Gi"}
    mounts = {m.mount_path: m.name for m in c.volume_mounts}
    volumes = {v.name: v for v in pod.volumes}
    assert volumes[mounts["/workspace/runs"]].persistent_volume_claim.claim_name == "runs"
    assert volumes[mounts["/etc/lockstep"]].config_map.name == "gpt-config" == cm.metadata.name
    assert volumes[mounts["/dev/shm"]].empty_dir.medium == "Memory"


def test_pytorchjob(config):
    s = K8sSettings(
        image="reg/lockstep:1", kind="pytorchjob", nodes=4, gpus_per_node=4, namespace="ml"
    )
    docs = render_manifests(s, load_config(config))
    job = docs[1]
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert (
        job["metadata"] == {"name": "lockstep", "namespace": "ml"}
        and job["spec"]["nprocPerNode"] == "4"
    )
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    for spec in replicas.values():
        template: client.V1PodTemplateSpec = as_model(spec["template"], "V1PodTemplateSpec")
        (c,) = template.spec.containers
        # what the operator looks for
        assert c.name == "pytorch" and c.ports[0].name == "pytorchjob-port"
        assert c.resources.limits == {"nvidia.com/gpu": "4"}
        assert c.command[:5] == ["torchrun", "--nnodes", "4", "--nproc-per-node", "4"]
    one = render_manifests(
        K8sSettings(image="x", kind="pytorchjob", nodes=1, gpus_per_node=16), load_config(config)
    )[1]
    assert list(one["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    for manifest in (job, one):
        check_pytorchjob(manifest)
        assert "elasticPolicy" not in manifest["spec"]


def test_elastic_pytorchjob_with_the_store_on_worker_0(config):
    """--rdzv-store node0: the operator's layout, no store of its own."""
    s = K8sSettings(
        image="x", kind="pytorchjob", name="gpt", nodes=2, min_nodes=1, rdzv_store="node0"
    )
    cm, job = render_manifests(s, load_config(config, {"distributed.world_size": None}))
    check_pytorchjob(job)
    (c,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert "--rdzv-endpoint" not in c["command"] and "--rdzv-conf" not in c["command"]


def test_elastic_pytorchjob(tmp_path):
    """nodes 1..2: the operator's elasticPolicy, Worker pods only, torchrun --nnodes 1:2 with restarts, and the
    batch settings every world size keeps in the ConfigMap."""
    path = tmp_path / "train.yaml"
    path.write_text("train: {max_steps: 4, batch_size: 16}\n")
    s = K8sSettings(
        image="reg/lockstep:1",
        kind="pytorchjob",
        name="gpt",
        nodes=2,
        min_nodes=1,
        gpus_per_node=4,
        rdzv_conf={"last_call_timeout": "10"},
    )
    cm, service, store, job = render_manifests(s, load_config(path))
    check_pytorchjob(job)
    assert job["spec"]["elasticPolicy"] == {
        "minReplicas": 1,
        "maxReplicas": 2,
        "rdzvBackend": "c10d",
        "maxRestarts": 3,
        "rdzvConf": [{"key": "last_call_timeout", "value": "10"}],
    }
    ((role, spec),) = job["spec"]["pytorchReplicaSpecs"].items()
    assert role == "Worker" and spec["replicas"] == 2  # the rendezvous host is <name>-worker-0
    (c,) = as_model(spec["template"], "V1PodTemplateSpec").spec.containers
    assert c.command[:7] == [
        "torchrun",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "3",
    ]
    assert c.ports[0].name == "pytorchjob-port"  # where the operator takes the rendezvous port from
    assert {e.name: e.value for e in c.env}["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    # the store is a pod of its own behind a Service: torchrun joins it there, as a client
    assert c.command[7:13] == [
        "--rdzv-endpoint",
        "gpt-rendezvous:29400",
        "--rdzv-id",
        "gpt",  # the id the store's --until-closed waits for
        "--rdzv-conf",
        "is_host=false,last_call_timeout=10",
    ]
    check_store(service, store, "gpt", spec["template"])
    train = yaml.safe_load(cm["data"]["config.yaml"])["train"]
    assert (train["batch_size"], train["micro_batch_size"], train["grad_accum"]) == (16, 2, None)
    fixed = render_manifests(
        K8sSettings(image="x", kind="pytorchjob", nodes=2, gpus_per_node=4, max_restarts=2),
        load_config(path),
    )[1]
    (c,) = fixed["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert c["command"][5:7] == ["--max-restarts", "2"]
    assert "--rdzv-endpoint" not in c["command"]  # the operator's static rendezvous at the Master
    # a static rendezvous: it would do nothing
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in str(c["env"])


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(memory="200GB"),
            "--memory '200GB' (resources.requests.memory) is not a Kubernetes quantity",
        ),
        (
            dict(cpu="2 cores"),
            "--cpu '2 cores' (resources.requests.cpu) is not a Kubernetes quantity",
        ),
        (dict(cpu="0"), "--cpu '0' (resources.requests.cpu) must be above zero"),
        (dict(shm_size="lots"), "--shm-size 'lots'"),
        (
            dict(nodes=2, gpus_per_node=4),
            "nodes(2) x gpus_per_node(4) = 8 != distributed.world_size(16)",
        ),
        (dict(name="GPT_run"), "name = 'GPT_run' must be a DNS label"),
        (dict(name="a" * 62, kind="indexed"), "at most 63 characters"),
        (
            dict(nodes=2, min_nodes=1, kind="indexed", world_size=None),
            "--nodes 1:2 needs --kind pytorchjob",
        ),
        (
            dict(rdzv_conf={"last_call_timeout": "5"}),
            "only an elastic job (--nodes MIN:MAX) has a c10d rendezvous",
        ),
        (
            dict(nodes=2, min_nodes=1, world_size=None, max_restarts=0),
            "--nnodes 1:2 with --max-restarts 0",
        ),
        (dict(nodes=2, min_nodes=1), "distributed.world_size = 16 fixes the world size"),
        (
            dict(rdzv_store="external"),
            "--rdzv-store external: only an elastic job (--nodes MIN:MAX) re-forms its group",
        ),
        (
            dict(nodes=2, min_nodes=1, world_size=None, rdzv_store="etcd"),
            "--rdzv-store 'etcd' is not one of node0, external",
        ),
        (
            dict(nodes=4, min_nodes=3, gpus_per_node=4, world_size=None),
            "cannot be kept at every world size",
        ),
    ],
)
def test_refused(config, kw, message):
    world = kw.pop("world_size", 16)
    settings = {"image": "x", "kind": "pytorchjob", "nodes": 2, "gpus_per_node": 8, **kw}
    with pytest.raises(ConfigError) as e:
        render_manifests(
            K8sSettings(**settings), load_config(config, {"distributed.world_size": world})
        )
    assert message in str(e.value)
