"""`lockstep k8s --kind trainjob`: the TrainJob checked against the CRD's own schema (jsonschema, pruning, CEL rules)
and Trainer's webhook rules, torchrun reading the topology the torch runtime injects, and what is refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytest.importorskip(
    "kubernetes", reason="the Kubernetes client is an optional dependency: pip install kubernetes"
)
jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema (test dependency)")
celpy = pytest.importorskip(
    "celpy", reason="pip install cel-python (test dependency: the CRD's CEL rules)"
)

from lockstep.config import load_config  # noqa: E402
from lockstep.errors import ConfigError  # noqa: E402
from lockstep.launch.k8s import K8sSettings  # noqa: E402
from lockstep.launch.k8s_render import render_manifests, render_yaml  # noqa: E402
from lockstep.launch.trainjob import (  # noqa: E402
    PATCH_MANAGER,
    build_trainjob,
    check_trainjob,
    runtime_note,
)

from .test_k8s import config  # noqa: E402, F401  (the fixture, written once)

DATA = Path(__file__).parent / "data"
SCHEMAS = {
    name: json.loads((DATA / f"trainjob-{name}.json").read_text()) for name in ("v2.3.0", "master")
}
CEL = celpy.Environment()


def pruned(value, schema: dict, where: str) -> list[str]:
    """Fields the API server would silently drop: not in `properties`, no additionalProperties, no
    x-kubernetes-preserve-unknown-fields (metadata is ObjectMeta, checked by the server itself)."""
    errors = []
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                errors += (
                    []
                    if key == "metadata" and where == ""
                    else pruned(item, props[key], f"{where}.{key}")
                )
            elif isinstance(extra, dict):
                errors += pruned(item, extra, f"{where}.{key}")
            elif props is not None or extra is None:
                errors.append(f"{where}.{key}: not in the schema (the API server would drop it)")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += pruned(item, schema["items"], f"{where}[{i}]")
    return errors


def cel_errors(value, schema: dict, where: str = "") -> list[str]:
    """x-kubernetes-validations on every node present in `value`, as the API server runs them on create: rules
    that compare with `oldSelf` are transition rules, run on update only."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue
        program = CEL.program(CEL.compile(rule["rule"]))
        # an evaluation error is no True either
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            errors.append(f"{where or '.'}: {rule['message']} ({rule['rule']})")
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            errors += cel_errors(item, sub, f"{where}.{key}") if sub else []
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += cel_errors(item, schema["items"], f"{where}[{i}]")
    return errors


def crd_errors(obj: dict, schema: dict) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]
    return errors + pruned(obj, schema, "") + cel_errors(obj, schema)


def webhook_errors(job: dict) -> list[str]:
    """Trainer v2.3's admission rules for what we render (torch.go Validate, jobset.go Validate)."""
    errors = []
    env = {e["name"] for e in job["spec"]["trainer"].get("env", [])}
    if env & {
        "PET_NNODES",
        "PET_NPROC_PER_NODE",
        "PET_NODE_RANK",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
    }:
        errors.append("trainer.env: must not have reserved envs")
    for patch in job["spec"].get("runtimePatches", []):
        # validation.IsDomainPrefixedPath: a DNS-1123 subdomain, '/', an HTTP path
        host, sep, path = patch["manager"].partition("/")
        if not (
            sep
            and re.fullmatch(
                r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", host
            )
            and re.fullmatch(r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+", path)
        ):
            errors.append(f"manager {patch['manager']!r}: must be a domain-prefixed path")
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            if rjob["name"] != "node":  # torch-distributed's only replicated job
                errors.append(f"replicated job {rjob['name']!r} does not exist in the runtime")
            for c in rjob["template"]["spec"]["template"]["spec"].get("containers", []):
                if c["name"] != "node" or c.get("env"):
                    errors.append(f"container {c['name']!r}: must exist and carry no env")
    return errors


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize(
    "kw",
    [
        dict(
            nodes=2,
            gpus_per_node=8,
            cpu="32",
            memory="200Gi",
            volume_claim="runs",
            extra_env={"NCCL_DEBUG": "WARN"},
            namespace="ml",
            name="gpt",
        ),
        dict(nodes=4, gpus_per_node=4, max_restarts=2),
        dict(nodes=1, gpus_per_node=16),
    ],
)
def test_trainjob_matches_the_crd(config, schema, kw):  # noqa: F811
    cfg = load_config(config)
    cm, job = render_manifests(K8sSettings(image="reg/lockstep:1", kind="trainjob", **kw), cfg)
    assert crd_errors(job, SCHEMAS[schema]) == []
    assert webhook_errors(job) == []
    # = world_size
    assert job["spec"]["trainer"]["numNodes"] * job["spec"]["trainer"]["numProcPerNode"] == 16


def test_the_checks_can_fail(config):  # noqa: F811
    _, job = render_manifests(
        K8sSettings(image="x", kind="trainjob", nodes=2, gpus_per_node=8), load_config(config)
    )
    schema = SCHEMAS["master"]
    bad = json.loads(json.dumps(job))
    bad["metadata"]["name"] = "GPT"
    bad["spec"]["trainer"]["numProcPerNode"] = 0
    bad["spec"]["trainer"]["numNodes"] = "2"
    bad["spec"]["trainer"]["gpus"] = 8
    bad["spec"]["managedBy"] = "me"
    bad["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] = "8 GPUs"
    del bad["spec"]["runtimeRef"]["name"]
    errors = "\n".join(crd_errors(bad, schema))
    for expected in (
        "metadata.name must match RFC 1035 DNS label format",
        "numProcPerNode must be greater than",
        "spec.trainer.numNodes: '2' is not of type 'integer'",
        ".spec.trainer.gpus: not in the schema",
        "ManagedBy must be",
        "'8 GPUs' does not match",
        "'name' is a required property",
    ):
        assert expected in errors, errors
    bad = json.loads(json.dumps(job))
    bad["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "3"})
    bad["spec"]["runtimePatches"][0]["manager"] = "lockstep"
    assert len(webhook_errors(bad)) == 2


def test_trainjob_fields(config):  # noqa: F811
    s = K8sSettings(
        image="reg/lockstep:1",
        name="gpt",
        nodes=2,
        gpus_per_node=8,
        cpu="32",
        memory="200Gi",
        volume_claim="runs",
        extra_env={"NCCL_DEBUG": "WARN"},
        max_restarts=2,
    )
    cm, job = render_manifests(s, load_config(config))  # trainjob is the default kind
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert (
        job["metadata"]["annotations"]["lockstep/check-runtime"]
        == "kubectl get clustertrainingruntimes torch-distributed"
    )
    spec = job["spec"]
    assert spec["runtimeRef"] == {
        "name": "torch-distributed",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    trainer = spec["trainer"]
    assert trainer["image"] == "reg/lockstep:1" and (
        trainer["numNodes"],
        trainer["numProcPerNode"],
    ) == (2, 8)
    assert trainer["command"] == [
        "torchrun",
        "--max-restarts",
        "2",
        "-m",
        "lockstep",
        "train",
        "--config",
        "/etc/lockstep/config.yaml",
    ]
    assert trainer["resourcesPerNode"] == {
        "limits": {"memory": "200Gi", "nvidia.com/gpu": "8"},
        "requests": {"cpu": "32", "memory": "200Gi"},
    }
    assert {e["name"]: e["value"] for e in trainer["env"]} == {
        "OMP_NUM_THREADS": "4",
        "NCCL_DEBUG": "WARN",
    }
    (patch,) = spec["runtimePatches"]
    assert patch["manager"] == PATCH_MANAGER
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]
    assert pod["metadata"]["labels"] == {
        "app.kubernetes.io/name": "lockstep",
        "lockstep/job": "gpt",
    }
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert (
        volumes[mounts["/etc/lockstep"]]["configMap"]["name"]
        == cm["metadata"]["name"]
        == "gpt-config"
    )
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volumes[mounts["/workspace/runs"]]["persistentVolumeClaim"]["claimName"] == "runs"
    one = render_manifests(K8sSettings(image="x", nodes=1, gpus_per_node=16), load_config(config))[
        1
    ]
    # no restarts by default
    assert one["spec"]["trainer"]["command"][:3] == ["torchrun", "-m", "lockstep"]
    assert "resourcesPerNode" in one["spec"]["trainer"] and "namespace" not in one["metadata"]


def test_torchrun_reads_the_runtime_env(config, monkeypatch):  # noqa: F811
    """The env the torch plugin injects into pod 1 of 2, and the rendered command: torchrun's own parser must come
    out with 2 nodes x 8 processes, node rank 1, a static rendezvous at pod 0 of the JobSet."""
    from torch.distributed.run import config_from_args, parse_args

    _, job = render_manifests(
        K8sSettings(image="x", name="gpt", nodes=2, gpus_per_node=8), load_config(config)
    )
    trainer = job["spec"]["trainer"]
    injected = {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "gpt-node-0-0.gpt",
        "PET_MASTER_PORT": "29500",
    }
    for key, value in injected.items():
        monkeypatch.setenv(key, value)
    command = trainer["command"]
    assert command[0] == "torchrun"
    args = parse_args(command[1:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
    assert (args.master_addr, args.master_port, args.rdzv_backend) == (
        "gpt-node-0-0.gpt",
        29500,
        "static",
    )
    launch, entry, entry_args = config_from_args(args)
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (2, 2, 8)
    assert (
        launch.rdzv_endpoint == "gpt-node-0-0.gpt:29500"
        and args.module
        and entry_args[-4:] == ["lockstep", "train", "--config", "/etc/lockstep/config.yaml"]
    )


def test_yaml_names_the_runtime(config):  # noqa: F811
    s = K8sSettings(image="x", nodes=2, gpus_per_node=8, runtime="torch-gpu-h200")
    text = render_yaml(s, load_config(config))
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob"] and docs[1]["spec"]["runtimeRef"][
        "name"
    ] == "torch-gpu-h200"
    comment = text.split("---\n")[1].split("apiVersion:")[0]
    assert comment.startswith(
        "# A Kubeflow Trainer v2 TrainJob on the ClusterTrainingRuntime 'torch-gpu-h200'."
    )
    assert (
        "\n#   kubectl get clustertrainingruntimes torch-gpu-h200\n" in comment
        and "--kind pytorchjob" in comment
    )
    assert all(line.startswith("#") for line in comment.splitlines())


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(nodes=2, min_nodes=1, world_size=None),
            "--nodes 1:2 needs --kind pytorchjob: Kubeflow Trainer v2's "
            "TrainJob has no elastic mode",
        ),
        (dict(extra_env={"PET_NNODES": "4"}), "--env PET_NNODES: the torch runtime sets"),
        (dict(port=29400), "--port 29400: the torch runtime fixes the rendezvous port at 29500"),
        (
            dict(runtime="Torch_Distributed"),
            "--runtime 'Torch_Distributed' is not a Kubernetes object name",
        ),
        (dict(name="a" * 49), "the job name may have at most 48 characters"),
    ],
)
def test_refused(config, kw, message):  # noqa: F811
    world = kw.pop("world_size", 16)
    with pytest.raises(ConfigError) as e:
        render_manifests(
            K8sSettings(**{"image": "x", "nodes": 2, "gpus_per_node": 8, **kw}),
            load_config(config, {"distributed.world_size": world}),
        )
    assert message in str(e.value)


def test_library_pieces():
    check_trainjob("torch-distributed", None, 2, 29500, ["NCCL_DEBUG"])  # accepted
    assert "`kubectl get clustertrainingruntimes rt`" in runtime_note("rt")
    job = build_trainjob(
        "j",
        None,
        "rt",
        nodes=3,
        nproc=1,
        image="i",
        command=["torchrun"],
        env=[],
        resources=None,
        volumes=[],
        mounts=[],
        labels={"a": "b"},
    )
    assert "env" not in job["spec"]["trainer"] and "resourcesPerNode" not in job["spec"]["trainer"]
    assert crd_errors(job, SCHEMAS["master"]) == [] and webhook_errors(job) == []
