"""A Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) that runs `lockstep train` on several pods.

A TrainJob names a ClusterTrainingRuntime (`torch-distributed` unless told) and overrides parts of it; Trainer
turns the two into a JobSet with one replicated Job `node` of numNodes pods. What Trainer v2.3 does with it (its
torch plugin and JobSet builder):
- the container `node` takes trainer.image and trainer.command, and trainer.env merged into the runtime's;
- trainer.resourcesPerNode is merged into that container's resources; numProcPerNode defaults to `auto`;
- the torch plugin injects PET_NNODES (numNodes), PET_NPROC_PER_NODE (numProcPerNode), PET_NODE_RANK (the Job
  completion index), PET_MASTER_ADDR (`<name>-node-0-0.<name>`) and PET_MASTER_PORT (29500), and opens that port.
  torchrun reads each of its flags from PET_<FLAG> when the flag is not given, so the command is a bare
  `torchrun -m lockstep train ...` that meets in a static rendezvous on pod 0. Setting a PET_* variable in
  trainer.env is refused by the plugin's webhook.
- volumes and volume mounts are not trainer fields: they go in spec.runtimePatches (Trainer >= 2.2), a patch keyed
  by a domain-prefixed `manager`, whose replicated job and containers must exist in the runtime and whose `node`
  container may not carry env.
- a patch cannot set the container's workingDir: the image's WORKDIR stays, and a relative path in the config
  (checkpoint.output_dir) resolves against it; point it into --mount-path.
Trainer has no elastic TrainJob yet (the torch plugin's TODO waits on elastic JobSets): a node range is refused.
Progress in `status.trainerStatus` needs nothing here: where the controller has the TrainJobStatus
feature gate it injects KUBEFLOW_TRAINER_SERVER_URL and its CA and token files into the pods, and
rank 0 reports to it (lockstep.train.trainjob_progress).
"""

from __future__ import annotations

import re
from typing import Any

from lockstep.errors import ConfigError

API_VERSION = "trainer.kubeflow.org/v1alpha1"
RUNTIME_KIND = "ClusterTrainingRuntime"
DEFAULT_RUNTIME = "torch-distributed"  # installed with Trainer's manifests and Helm chart
NODE = "node"  # the runtime's replicated job, and the container the torch plugin configures in it
TRAINER_PORT = 29500  # PET_MASTER_PORT and the container port the torch plugin sets (constants.ContainerTrainerPort)
# owner of our runtime patch; the webhook wants a domain-prefixed path
PATCH_MANAGER = "lockstep/k8s"
RESERVED_ENV = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
)
# a Kubernetes object name (DNS-1123 subdomain): what a ClusterTrainingRuntime's name must be
OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check_trainjob(
    runtime: str, min_nodes: int | None, nodes: int, port: int | None, env: list[str]
) -> None:
    """What a TrainJob cannot take, refused before the webhook or the pods refuse it."""
    if min_nodes is not None and min_nodes < nodes:
        raise ConfigError(
            f"--nodes {min_nodes}:{nodes} needs --kind pytorchjob: Kubeflow Trainer v2's TrainJob has "
            "no elastic mode (numNodes is a fixed count; the torch runtime starts a static rendezvous). "
            "Use --kind pytorchjob on a cluster with training-operator v1, or a fixed --nodes"
        )
    if not (OBJECT_NAME.fullmatch(runtime) and len(runtime) <= 253):
        raise ConfigError(
            f"--runtime {runtime!r} is not a Kubernetes object name (lowercase letters, digits, '-', "
            f"'.'); list the installed ones with `kubectl get clustertrainingruntimes`"
        )
    if port is not None and port != TRAINER_PORT:
        raise ConfigError(
            f"--port {port}: the torch runtime fixes the rendezvous port at {TRAINER_PORT} "
            "(PET_MASTER_PORT); drop --port, or use --kind pytorchjob / indexed"
        )
    reserved = sorted(set(env) & set(RESERVED_ENV))
    if reserved:
        raise ConfigError(
            f"--env {', '.join(reserved)}: the torch runtime sets {', '.join(RESERVED_ENV)} itself and "
            "its webhook refuses a TrainJob that sets them; drop them (use --nodes / --gpus-per-node / "
            "--procs-per-node)"
        )


def runtime_note(runtime: str) -> str:
    """One line for the user: the kind, the runtime the TrainJob names, and how to check the cluster has it."""
    return (
        f"a Kubeflow Trainer v2 TrainJob (the default --kind; on a training-operator v1 cluster use --kind "
        f"pytorchjob) on the {RUNTIME_KIND} {runtime!r}: check that the cluster has it with `kubectl get "
        f"clustertrainingruntimes {runtime}`; list them with `kubectl get clustertrainingruntimes`, pick another "
        "with --runtime NAME"
    )


def runtime_comment(runtime: str) -> str:
    """YAML comment lines above the TrainJob: the same facts as runtime_note, one command per line."""
    return (
        f"# A Kubeflow Trainer v2 TrainJob on the {RUNTIME_KIND} {runtime!r}. Check that the cluster has it:\n"
        f"#   kubectl get clustertrainingruntimes {runtime}\n"
        "# List the installed runtimes with `kubectl get clustertrainingruntimes`; pick another with\n"
        "# `lockstep k8s --runtime NAME`; on a training-operator v1 cluster use `lockstep k8s --kind pytorchjob`.\n"
    )


def build_trainjob(
    name: str,
    namespace: str | None,
    runtime: str,
    *,
    nodes: int,
    nproc: int,
    image: str,
    command: list[str],
    env: list[dict[str, Any]],
    resources: dict[str, Any] | None,
    volumes: list[dict[str, Any]],
    mounts: list[dict[str, Any]],
    labels: dict[str, str],
) -> dict[str, Any]:
    """The TrainJob as a plain dict (a custom resource); env, resources, volumes and mounts already serialized."""
    metadata: dict[str, Any] = {
        "name": name,
        **({"namespace": namespace} if namespace else {}),
        "labels": labels,
        "annotations": {
            "lockstep/runtime": f"{RUNTIME_KIND}/{runtime}",
            "lockstep/check-runtime": f"kubectl get clustertrainingruntimes {runtime}",
        },
    }
    trainer: dict[str, Any] = {
        "image": image,
        "command": command,
        "numNodes": nodes,
        "numProcPerNode": nproc,
    }
    if env:
        trainer["env"] = env
    if resources:
        trainer["resourcesPerNode"] = resources
    pod_patch = {
        "metadata": {"labels": labels},
        "spec": {"volumes": volumes, "containers": [{"name": NODE, "volumeMounts": mounts}]},
    }
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": NODE, "template": {"spec": {"template": pod_patch}}}
                    ]
                }
            }
        },
    }
    spec = {
        "runtimeRef": {"name": runtime, "apiGroup": "trainer.kubeflow.org", "kind": RUNTIME_KIND},
        "trainer": trainer,
        "runtimePatches": [patch],
    }
    return {"apiVersion": API_VERSION, "kind": "TrainJob", "metadata": metadata, "spec": spec}
