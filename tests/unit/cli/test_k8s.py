"""`lockstep k8s`'s arguments (lockstep/cli/k8s.py): manifests to stdout or a file, the choices it takes, and
what it refuses. The manifests themselves: tests/unit/launch/test_k8s.py."""

from __future__ import annotations

import argparse

import pytest
import yaml

pytest.importorskip(
    "kubernetes", reason="the Kubernetes client is an optional dependency: pip install kubernetes"
)

from conftest import run_main  # noqa: E402

from lockstep.cli import k8s as k8s_cli  # noqa: E402

from ..launch.test_k8s import config  # noqa: E402, F401  (the fixture, written once)


def test_cli_writes_file(config, tmp_path, capsys):  # noqa: F811
    p = argparse.ArgumentParser()
    k8s_cli.add_arguments(p)
    out = tmp_path / "job.yaml"
    argv = [
        str(config),
        "--image",
        "x",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--kind",
        "indexed",
        "--set",
        "train.max_steps=9",
        "-o",
        str(out),
    ]
    assert k8s_cli.run(p.parse_args(argv), argv) == 0
    assert "kubectl apply -f" in capsys.readouterr().out
    cm = next(yaml.safe_load_all(out.read_text()))
    assert yaml.safe_load(cm["data"]["config.yaml"])["train"]["max_steps"] == 9


def test_manifests_to_stdout(config, capsys):  # noqa: F811
    code, out, err = run_main(
        capsys,
        "k8s",
        config,
        "--image",
        "reg/lockstep:1",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--name",
        "gpt",
        "--env",
        "NCCL_DEBUG=WARN",
        "--kind",
        "pytorchjob",
    )
    assert code == 0 and err == ""
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    assert docs[1]["metadata"]["name"] == "gpt" and "NCCL_DEBUG" in out


def test_refused_input(config, capsys):  # noqa: F811
    code, out, err = run_main(capsys, "k8s", config, "--image", "x", "--kind", "deployment")
    assert code == 2 and out == "" and "argument --kind: invalid choice: 'deployment'" in err
    assert "'pytorchjob'" in err and "'indexed'" in err
    code, _, err = run_main(capsys, "k8s", config)
    assert code == 2 and "the following arguments are required: --image" in err
    assert run_main(capsys, "k8s", config, "--image", "x", "--env", "NOEQUALS") == (
        2,
        "",
        "lockstep k8s: error: --env 'NOEQUALS' is not KEY=VALUE; e.g. --env NCCL_DEBUG=INFO\n",
    )


def test_node_range(config, tmp_path, capsys):  # noqa: F811
    """--nodes MIN:MAX: an elastic PyTorchJob; its batch plan printed (with the file's name, or on stderr)."""
    code, out, err = run_main(
        capsys,
        "k8s",
        config,
        "--image",
        "x",
        "--nodes",
        "1:2",
        "--gpus-per-node",
        "8",
        "--set",
        "distributed.world_size=none",
        "--kind",
        "pytorchjob",
    )
    assert code == 0 and "elastic job; the batch plan at each world size" in err
    docs = list(yaml.safe_load_all(out))
    # the rendezvous store in a pod of its own, up before the workers; how to remove it after
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Job", "PyTorchJob"]
    assert "ends with the training job" in err
    assert "`kubectl delete job,service lockstep-rendezvous`" in err
    job = docs[3]
    assert (
        job["spec"]["elasticPolicy"]["minReplicas"] == 1
        and job["spec"]["elasticPolicy"]["maxReplicas"] == 2
    )
    code, out, err = run_main(
        capsys,
        "k8s",
        config,
        "--image",
        "x",
        "--nodes",
        "1:2",
        "--gpus-per-node",
        "8",
        "--set",
        "distributed.world_size=none",
        "-o",
        tmp_path / "job.yaml",
        "--kind",
        "pytorchjob",
    )
    assert (
        code == 0
        and err == ""
        and "16 ranks: global batch 16" in out
        and "8 ranks: global batch 16" in out
    )
    code, _, err = run_main(
        capsys,
        "k8s",
        config,
        "--image",
        "x",
        "--nodes",
        "1:2",
        "--kind",
        "indexed",
        "--gpus-per-node",
        "8",
        "--set",
        "distributed.world_size=none",
    )
    assert code == 2 and "--nodes 1:2 needs --kind pytorchjob" in err
    code, out, err = run_main(
        capsys,
        *("k8s", config, "--image", "x", "--nodes", "1:2", "--gpus-per-node", "8"),
        *("--set", "distributed.world_size=none", "--kind", "pytorchjob", "--rdzv-store", "node0"),
    )
    assert code == 0 and "rendezvous store" not in err
    assert [d["kind"] for d in yaml.safe_load_all(out)] == ["ConfigMap", "PyTorchJob"]


def test_trainjob_is_the_default(config, tmp_path, capsys):  # noqa: F811
    """No --kind: a Trainer v2 TrainJob; the runtime it needs and how to check for it, on stderr (or stdout with
    -o); --runtime picks another; a node range is refused with the way out."""
    code, out, err = run_main(
        capsys, "k8s", config, "--image", "x", "--nodes", "2", "--gpus-per-node", "8"
    )
    assert code == 0
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "TrainJob"]
    assert docs[1]["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert err.startswith(
        "lockstep k8s: a Kubeflow Trainer v2 TrainJob (the default --kind; on a training-operator "
        "v1 cluster use --kind pytorchjob) on the ClusterTrainingRuntime 'torch-distributed'"
    )
    assert (
        "`kubectl get clustertrainingruntimes torch-distributed`" in err
        and "--kind pytorchjob" in err
    )
    code, out, err = run_main(
        capsys,
        "k8s",
        config,
        "--image",
        "x",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--runtime",
        "torch-h200",
        "-o",
        tmp_path / "job.yaml",
    )
    assert code == 0 and err == "" and "`kubectl get clustertrainingruntimes torch-h200`" in out
    assert (
        list(yaml.safe_load_all((tmp_path / "job.yaml").read_text()))[1]["spec"]["runtimeRef"][
            "name"
        ]
        == "torch-h200"
    )
    code, out, err = run_main(
        capsys,
        "k8s",
        config,
        "--image",
        "x",
        "--nodes",
        "1:2",
        "--gpus-per-node",
        "8",
        "--set",
        "distributed.world_size=none",
    )
    assert (code, out) == (2, "") and "--nodes 1:2 needs --kind pytorchjob" in err
