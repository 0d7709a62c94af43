"""Render Kubernetes manifests for a training config: a Kubeflow Trainer v2 TrainJob (the default), a training-operator
v1 PyTorchJob, or an Indexed Job + Service.

The resolved config goes into a ConfigMap; resource requests are checked as Kubernetes quantities
and nodes x processes against distributed.world_size before anything is written. Apply with `kubectl
apply -f FILE`. A TrainJob names the ClusterTrainingRuntime it needs (--runtime, default
torch-distributed); a note on stderr says how to check the cluster has it. `--nodes MIN:MAX` renders
an elastic PyTorchJob (Trainer v2 has no elastic TrainJob), whose batch plan at each world size is
printed, with its rendezvous store in a pod of its own (--rdzv-store; lockstep.launch.k8s_store)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lockstep.cli.launch_options import (
    add_launch_options,
    key_values,
    options_from,
    print_elastic_plan,
)
from lockstep.config import load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="training config (YAML); stored in a ConfigMap")
    p.add_argument("--image", required=True, help="container image with lockstep installed")
    p.add_argument(
        "--kind",
        choices=["trainjob", "pytorchjob", "indexed"],
        default="trainjob",
        help="trainjob (Kubeflow Trainer v2, default), pytorchjob (training-operator v1, also for an "
        "elastic --nodes MIN:MAX) or indexed (plain Job + headless Service, no operator)",
    )
    p.add_argument(
        "--runtime",
        default="torch-distributed",
        metavar="NAME",
        help="trainjob: the ClusterTrainingRuntime to run on (default torch-distributed; list them with "
        "`kubectl get clustertrainingruntimes`)",
    )
    p.add_argument("--name", default="lockstep", help="job name, a DNS label (default lockstep)")
    p.add_argument("--namespace", help="namespace (default: kubectl's)")
    p.add_argument(
        "--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per pod; 0 = CPU workers"
    )
    p.add_argument(
        "--procs-per-node",
        type=int,
        help="CPU worker processes per pod (default: one per GPU, or 1)",
    )
    p.add_argument("--cpu", help="CPU request per pod, e.g. 8 or 500m")
    p.add_argument("--memory", help="memory request and limit per pod, e.g. 64Gi")
    p.add_argument("--shm-size", default="8Gi", help="/dev/shm size (default 8Gi)")
    p.add_argument(
        "--port", type=int, help="rendezvous port (default 29500, the only one a TrainJob takes)"
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="container variable (repeatable)",
    )
    p.add_argument("--volume-claim", help="PersistentVolumeClaim for the run directory")
    p.add_argument(
        "--mount-path", default="/workspace/runs", help="where --volume-claim is mounted"
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, baked into the ConfigMap",
    )
    p.add_argument(
        "--rdzv-store",
        choices=("external", "node0"),
        help="an elastic job's rendezvous store: in a pod of its own behind a Service (default: "
        "the job outlives any worker pod), or hosted by <name>-worker-0 (the job ends with it)",
    )
    p.add_argument("--output", "-o", metavar="FILE", help="write the YAML here instead of stdout")
    add_launch_options(
        p,
        nodes_help="pods, one torchrun each (default 1), or a range for an elastic PyTorchJob "
        "that trains on the pods left when one is lost (needs --kind pytorchjob)",
    )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        from lockstep.launch.k8s import K8sSettings, check_settings, external_store
        from lockstep.launch.k8s_render import render_yaml, with_batch_plan
        from lockstep.launch.k8s_store import store_name
        from lockstep.launch.trainjob import runtime_note
    except ImportError as e:
        print(
            f"lockstep k8s: error: {e}; install the Kubernetes client: pip install kubernetes",
            file=sys.stderr,
        )
        return 1

    cfg = load_config(args.config, key_values(args.sets, "--set"))
    options = options_from(args)
    settings = K8sSettings(
        image=args.image,
        kind=args.kind,
        runtime=args.runtime,
        name=args.name,
        namespace=args.namespace,
        **options.as_settings(),
        rdzv_store=args.rdzv_store,
        gpus_per_node=args.gpus_per_node,
        procs_per_node=args.procs_per_node,
        cpu=args.cpu,
        memory=args.memory,
        shm_size=args.shm_size,
        port=args.port,
        extra_env=key_values(args.env, "--env"),
        volume_claim=args.volume_claim,
        mount_path=args.mount_path,
    )
    text = render_yaml(settings, cfg)
    _, plans = with_batch_plan(settings, cfg, check_settings(settings, cfg))
    # stderr: YAML on stdout
    print_elastic_plan("lockstep k8s", plans, file=sys.stdout if args.output else sys.stderr)
    if args.kind == "trainjob":  # on stderr when the manifests go to stdout
        print(
            f"lockstep k8s: {runtime_note(args.runtime)}",
            file=sys.stdout if args.output else sys.stderr,
        )
    if external_store(settings):
        print(
            f"lockstep k8s: the rendezvous store (the Job and Service {store_name(settings.name)}) "
            "ends with the training job; if the job is stopped by a signal (its agents then leave "
            f"the rendezvous open), `kubectl delete job,service {store_name(settings.name)}` "
            "removes it",
            file=sys.stdout if args.output else sys.stderr,
        )
    if args.output:
        Path(args.output).write_text(text)
        print(
            f"wrote {args.kind} manifests to {args.output}; apply with `kubectl apply -f {args.output}`"
        )
    else:
        print(text, end="")
    return 0
