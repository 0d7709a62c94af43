"""Render Kubernetes manifests that run `lockstep train` on several pods, one pod per node.

Three shapes, each with the resolved training config in a ConfigMap mounted at /etc/lockstep:
- `trainjob` (the default): a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) on a
  ClusterTrainingRuntime, `torch-distributed` unless told; see lockstep/launch/trainjob.py.
- `pytorchjob`: a Kubeflow PyTorchJob (kubeflow.org/v1), for clusters with training-operator v1. The operator
  sets PET_MASTER_ADDR, PET_MASTER_PORT, PET_NODE_RANK and PET_NNODES, which torchrun reads.
- `indexed`: a plain Indexed Job + headless Service, for clusters without the operator. Pod i is
  reachable as `<name>-i.<name>`; its completion index is the node rank, and pod 0 hosts torchrun's
  static rendezvous.
Pod templates are built from the `kubernetes` client's models, so field names and types are checked
as they are built; resource requests are parsed as Kubernetes quantities before anything is written, and the
job name is checked against the longest name the operator derives from it (lockstep/launch/k8s_names.py).

An elastic job (`nodes` a range MIN..MAX) is a PyTorchJob with the operator's `elasticPolicy` (field
names as in training-operator v1.9's CRD): Worker pods only, torchrun `--nnodes MIN:MAX
--max-restarts N`, and a c10d store in a pod of its own that no worker's loss takes down
(lockstep.launch.k8s_store; with `rdzv_store` node0, `<name>-worker-0` hosts it, as the operator
would have it). When a pod is lost the others re-form the group at the smaller world size and resume
from the last commit; when the operator has replaced the pod, the group grows back at the next
rendezvous round. The global batch stays: the ConfigMap holds the batch plan's settings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from kubernetes import client
from kubernetes.utils import parse_quantity

from lockstep.config import Config, dump_config
from lockstep.errors import ConfigError
from lockstep.launch.k8s_names import check_job_name
from lockstep.launch.k8s_store import STORES, store_endpoint
from lockstep.launch.options import check_elastic, procs_per_node
from lockstep.launch.trainjob import DEFAULT_RUNTIME, NODE, build_trainjob, check_trainjob

CONFIG_DIR = "/etc/lockstep"
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_PORT = 29500  # rendezvous port on pod 0; also the one a TrainJob's torch runtime fixes
KINDS = ("trainjob", "pytorchjob", "indexed")


@dataclass
class K8sSettings:
    image: str  # container image with lockstep (and the data, or a volume that holds it)
    # Trainer v2, training-operator v1, plain Job
    kind: Literal["trainjob", "pytorchjob", "indexed"] = "trainjob"
    runtime: str = DEFAULT_RUNTIME  # trainjob: the ClusterTrainingRuntime it runs on
    name: str = "lockstep"  # job name; also the Service, the ConfigMap (<name>-config) and the pod host names
    namespace: str | None = None  # None = the namespace kubectl applies to
    nodes: int = 1  # pods, one torchrun each (the most, for an elastic job)
    # elastic: the fewest pods the job trains on (`--nodes MIN:MAX`); None = fixed
    min_nodes: int | None = None
    # torchrun's group restarts on a failure; None = 0, or 3 for an elastic job
    max_restarts: int | None = None
    # elastic: more c10d rendezvous settings
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    # elastic: who serves the c10d store: None = external (lockstep.launch.k8s_store), node0 =
    # worker-0
    rdzv_store: str | None = None
    gpus_per_node: int = 0  # nvidia.com/gpu limit per pod; 0 = CPU workers
    # worker processes per pod; None = gpus_per_node (or 1 without GPUs)
    procs_per_node: int | None = None
    cpu: str | None = None  # CPU request per pod, a quantity: 8, 500m
    memory: str | None = None  # memory request and limit per pod, a quantity: 64Gi
    shm_size: str = "8Gi"  # size of /dev/shm (DataLoader workers pass batches through it)
    # rendezvous port on pod 0; None = 29500 (the only one a TrainJob takes)
    port: int | None = None
    extra_env: dict[str, str] = field(default_factory=dict)  # variables set in every container
    # PersistentVolumeClaim mounted at mount_path (checkpoints outlive pods)
    volume_claim: str | None = None
    # where volume_claim is mounted; point checkpoint.output_dir into it
    mount_path: str = "/workspace/runs"
    workdir: str = "/workspace"  # working directory of the container


def _quantity(flag: str, field_path: str, value: str | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    try:
        amount = parse_quantity(value)
    except ValueError:
        raise ConfigError(
            f"{flag} {value!r} ({field_path}) is not a Kubernetes quantity; use e.g. 8, 500m, 64Gi, "
            "512Mi (binary suffixes Ki Mi Gi, decimal k M G)"
        ) from None
    if amount < 0 or (amount == 0 and not allow_zero):
        raise ConfigError(f"{flag} {value!r} ({field_path}) must be above zero")


def is_elastic(s: K8sSettings) -> bool:
    return s.min_nodes is not None and s.min_nodes < s.nodes


def external_store(s: K8sSettings) -> bool:
    """The job's c10d store in a pod of its own (the default for an elastic job)."""
    return is_elastic(s) and s.rdzv_store != "node0"


def check_settings(s: K8sSettings, cfg: Config) -> int:
    """Every rule checkable before the manifest is applied; returns the processes per pod."""
    if s.kind not in KINDS:
        raise ConfigError(f"kind = {s.kind!r} is not one of {', '.join(map(repr, KINDS))}")
    check_elastic(s.min_nodes, s.nodes, s.max_restarts, s.rdzv_conf)
    if s.kind == "trainjob":
        check_trainjob(s.runtime, s.min_nodes, s.nodes, s.port, list(s.extra_env))
    nproc = procs_per_node(s.nodes, s.gpus_per_node, s.procs_per_node, cfg)
    if is_elastic(s) and s.kind == "indexed":
        raise ConfigError(
            f"--nodes {s.min_nodes}:{s.nodes} needs --kind pytorchjob: the pods of an Indexed Job meet "
            "in a static rendezvous of a fixed size; the training operator's elasticPolicy runs an "
            "elastic (c10d) one. Use --kind pytorchjob, or a fixed --nodes"
        )
    if s.rdzv_store not in (None, *STORES):
        raise ConfigError(f"--rdzv-store {s.rdzv_store!r} is not one of {', '.join(STORES)}")
    if s.rdzv_store == "external" and not is_elastic(s):
        raise ConfigError(
            "--rdzv-store external: only an elastic job (--nodes MIN:MAX) re-forms its group "
            "through a rendezvous store; a fixed-size job meets in a static one and ends with any "
            "pod. Drop --rdzv-store, or give --nodes a range"
        )
    if s.rdzv_conf and not is_elastic(s):
        raise ConfigError(
            f"--rdzv-conf {','.join(s.rdzv_conf)}: only an elastic job (--nodes MIN:MAX) has a c10d "
            "rendezvous to configure; a fixed-size job on Kubernetes meets in a static one"
        )
    check_job_name(s.kind, s.name, s.nodes, is_elastic(s))
    if not s.image:
        raise ConfigError(
            "no container image; pass --image REGISTRY/IMAGE:TAG with lockstep installed"
        )
    _quantity("--cpu", "resources.requests.cpu", s.cpu)
    _quantity("--memory", "resources.requests.memory", s.memory)
    _quantity("--shm-size", "volumes[dshm].emptyDir.sizeLimit", s.shm_size)
    if not 0 < port(s) < 65536:
        raise ConfigError(f"port = {s.port} must be in 1..65535")
    for key in s.extra_env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", key):
            raise ConfigError(f"--env {key!r} is not a valid environment variable name")
    return nproc


def port(s: K8sSettings) -> int:
    return DEFAULT_PORT if s.port is None else s.port


def build_resources(s: K8sSettings) -> client.V1ResourceRequirements:
    requests = {k: v for k, v in (("cpu", s.cpu), ("memory", s.memory)) if v is not None}
    # a memory limit equal to the request: no surprise OOM kills
    limits = {"memory": s.memory} if s.memory else {}
    if s.gpus_per_node:
        # extended resources: the request defaults to the limit
        limits[GPU_RESOURCE] = str(s.gpus_per_node)
    return client.V1ResourceRequirements(requests=requests or None, limits=limits or None)


def build_pod_template(
    s: K8sSettings,
    container_name: str,
    command: list[str],
    env: list[client.V1EnvVar],
    **pod_fields: Any,
) -> client.V1PodTemplateSpec:
    mounts = [
        client.V1VolumeMount(name="config", mount_path=CONFIG_DIR, read_only=True),
        client.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
    ]
    volumes = [
        client.V1Volume(
            name="config", config_map=client.V1ConfigMapVolumeSource(name=f"{s.name}-config")
        ),
        client.V1Volume(
            name="dshm",
            empty_dir=client.V1EmptyDirVolumeSource(medium="Memory", size_limit=s.shm_size),
        ),
    ]
    if s.volume_claim:
        mounts.append(client.V1VolumeMount(name="runs", mount_path=s.mount_path))
        volumes.append(
            client.V1Volume(
                name="runs",
                persistent_volume_claim=client.V1PersistentVolumeClaimVolumeSource(
                    claim_name=s.volume_claim
                ),
            )
        )
    env = env + [client.V1EnvVar(name=k, value=v) for k, v in s.extra_env.items()]
    container = client.V1Container(
        name=container_name,
        image=s.image,
        command=command,
        env=env,
        working_dir=s.workdir,
        resources=build_resources(s),
        volume_mounts=mounts,
        # the training operator takes the rendezvous port from the port with this name
        ports=[
            client.V1ContainerPort(
                name="pytorchjob-port" if s.kind == "pytorchjob" else "rendezvous",
                container_port=port(s),
            )
        ],
    )
    return client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(
            labels={"app.kubernetes.io/name": "lockstep", "lockstep/job": s.name}
        ),
        spec=client.V1PodSpec(containers=[container], volumes=volumes, **pod_fields),
    )


def omp_env(s: K8sSettings, nproc: int) -> client.V1EnvVar:
    """OMP_NUM_THREADS = the pod's CPU request shared among its workers (at least 1)."""
    cpus = parse_quantity(s.cpu) if s.cpu else nproc
    return client.V1EnvVar(name="OMP_NUM_THREADS", value=str(max(1, int(cpus) // nproc)))


def build_config_map(s: K8sSettings, cfg: Config) -> client.V1ConfigMap:
    return client.V1ConfigMap(
        api_version="v1",
        kind="ConfigMap",
        metadata=client.V1ObjectMeta(name=f"{s.name}-config", namespace=s.namespace),
        data={"config.yaml": dump_config(cfg)},
    )


def worker_args() -> list[str]:
    return ["-m", "lockstep", "train", "--config", f"{CONFIG_DIR}/config.yaml"]


def build_pytorchjob(s: K8sSettings, nproc: int) -> dict[str, Any]:
    """A kubeflow.org/v1 PyTorchJob: a custom resource, so a dict around model-built pod templates.

    Fixed size: the operator passes MASTER_ADDR / MASTER_PORT / PET_NODE_RANK / PET_NNODES, torchrun meets in a
    static rendezvous at the Master pod. Elastic: Worker pods only (the operator's webhook wants Workers with an
    elasticPolicy, and a Master would pin node ranks); the operator passes PET_RDZV_ENDPOINT
    (`<name>-worker-0:<the pytorchjob-port>`), PET_RDZV_BACKEND, PET_NNODES (MIN:MAX) and PET_MAX_RESTARTS.
    """
    restarts = check_elastic(s.min_nodes, s.nodes, s.max_restarts, s.rdzv_conf)
    nnodes = f"{s.min_nodes}:{s.nodes}" if is_elastic(s) else str(s.nodes)
    # the store's Service instead of the operator's PET_RDZV_ENDPOINT (worker-0); no worker hosts it
    conf = ",".join(f"{k}={v}" for k, v in {"is_host": "false", **s.rdzv_conf}.items())
    store = ["--rdzv-endpoint", store_endpoint(s.name), "--rdzv-id", s.name, "--rdzv-conf", conf]
    command = [
        "torchrun",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        *(["--max-restarts", str(restarts)] if restarts else []),
        *(store if external_store(s) else []),
        *worker_args(),
    ]
    env = [omp_env(s, nproc)]
    if is_elastic(s):
        # torch's agents would share one rendezvous TCP store across every restart of the group, and a pod that
        # rejoins has another restart count than the survivors: with this set, rank 0's worker hosts a fresh store
        # for each rendezvous round (lockstep's runtime then joins with env://). A fixed-size job's static
        # rendezvous always shares its store; the variable does nothing there.
        env.append(client.V1EnvVar(name="TORCH_DISABLE_SHARE_RDZV_TCP_STORE", value="1"))
    template = build_pod_template(s, "pytorch", command, env)  # the operator wants "pytorch"
    pod = client.ApiClient().sanitize_for_serialization(template)
    metadata = {"name": s.name, **({"namespace": s.namespace} if s.namespace else {})}
    spec: dict[str, Any] = {"nprocPerNode": str(nproc)}
    if is_elastic(s):
        # OnFailure: a failed container restarts in its pod and rejoins; a lost pod is recreated by the operator.
        # With --rdzv-store node0, worker-0 hosts the c10d store: while it is down, the others cannot
        # re-form.
        spec["elasticPolicy"] = {
            "minReplicas": s.min_nodes,
            "maxReplicas": s.nodes,
            "rdzvBackend": "c10d",
            "maxRestarts": restarts,
            **(
                {"rdzvConf": [{"key": k, "value": v} for k, v in s.rdzv_conf.items()]}
                if s.rdzv_conf
                else {}
            ),
        }
        spec["pytorchReplicaSpecs"] = {
            "Worker": {"replicas": s.nodes, "restartPolicy": "OnFailure", "template": pod}
        }
    else:
        replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
        if s.nodes > 1:
            replicas["Worker"] = {
                "replicas": s.nodes - 1,
                "restartPolicy": "OnFailure",
                "template": pod,
            }
        spec["pytorchReplicaSpecs"] = replicas
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": spec,
    }


def build_k8s_trainjob(s: K8sSettings, nproc: int) -> dict[str, Any]:
    """A TrainJob on the runtime `s.runtime`: the container, volumes and mounts of the other kinds' pod template,
    split into the trainer fields and the runtime patch; the torch runtime passes torchrun its topology (PET_*)."""
    restarts = check_elastic(s.min_nodes, s.nodes, s.max_restarts, s.rdzv_conf)
    command = ["torchrun", *(["--max-restarts", str(restarts)] if restarts else []), *worker_args()]
    template = build_pod_template(s, NODE, command, [omp_env(s, nproc)])
    pod = client.ApiClient().sanitize_for_serialization(template)
    (container,) = pod["spec"]["containers"]
    return build_trainjob(
        s.name,
        s.namespace,
        s.runtime,
        nodes=s.nodes,
        nproc=nproc,
        image=s.image,
        command=command,
        env=container["env"],
        resources=container.get("resources"),
        volumes=pod["spec"]["volumes"],
        mounts=container["volumeMounts"],
        labels=pod["metadata"]["labels"],
    )


def build_indexed_job(s: K8sSettings, nproc: int) -> tuple[client.V1Service, client.V1Job]:
    """Headless Service (stable DNS per pod) + Indexed Job whose completion index is the node rank."""
    labels = {"lockstep/job": s.name}
    service = client.V1Service(
        api_version="v1",
        kind="Service",
        metadata=client.V1ObjectMeta(name=s.name, namespace=s.namespace),
        spec=client.V1ServiceSpec(
            cluster_ip="None",
            selector=labels,
            publish_not_ready_addresses=True,  # pod DNS names resolve as soon as pods have addresses
            ports=[client.V1ServicePort(name="rendezvous", port=port(s), target_port=port(s))],
        ),
    )
    index = client.V1EnvVar(
        name="NODE_RANK",
        value_from=client.V1EnvVarSource(
            field_ref=client.V1ObjectFieldSelector(
                field_path="metadata.annotations['batch.kubernetes.io/job-completion-index']"
            )
        ),
    )
    # static rendezvous: pod 0 (`<name>-0.<service>`) hosts the store, no host-name matching involved
    command = [
        "torchrun",
        "--nnodes",
        str(s.nodes),
        "--nproc-per-node",
        str(nproc),
        "--node-rank",
        "$(NODE_RANK)",
        "--master-addr",
        f"{s.name}-0.{s.name}",
        "--master-port",
        str(port(s)),
        *worker_args(),
    ]
    template = build_pod_template(
        s, "lockstep", command, [index, omp_env(s, nproc)], subdomain=s.name, restart_policy="Never"
    )
    job = client.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=client.V1ObjectMeta(name=s.name, namespace=s.namespace),
        spec=client.V1JobSpec(
            completion_mode="Indexed",
            completions=s.nodes,
            parallelism=s.nodes,
            backoff_limit=0,  # a static rendezvous cannot take a replaced pod: fail the job, resubmit to resume
            template=template,
        ),
    )
    return service, job
