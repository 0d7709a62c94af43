"""lockstep/launch/k8s_render.py: the YAML stream kubectl applies (the ConfigMap's config a readable block, no
anchors, objects in apply order, a TrainJob under the comment that names its runtime), and the config an elastic
job's ConfigMap holds: the global batch every world size in its range keeps."""

from __future__ import annotations

import pytest
import yaml

pytest.importorskip(
    "kubernetes", reason="the Kubernetes client is an optional dependency: pip install kubernetes"
)

from lockstep.config import load_config  # noqa: E402
from lockstep.launch.k8s import K8sSettings  # noqa: E402
from lockstep.launch.k8s_render import render_manifests, render_yaml, with_batch_plan  # noqa: E402
from lockstep.launch.trainjob import runtime_comment  # noqa: E402


def test_the_stream_is_readable_and_in_apply_order(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("train: {max_steps: 4, batch_size: 16}\n")
    cfg = load_config(config)
    for kind, kinds in (
        ("trainjob", ["ConfigMap", "TrainJob"]),
        ("pytorchjob", ["ConfigMap", "PyTorchJob"]),
        ("indexed", ["ConfigMap", "Service", "Job"]),
    ):
        s = K8sSettings(image="img", kind=kind, nodes=2, procs_per_node=2)
        text = render_yaml(s, cfg)
        docs = list(yaml.safe_load_all(text))
        assert [d["kind"] for d in docs] == kinds == [d["kind"] for d in render_manifests(s, cfg)]
        # the pod template Master and Worker share: no anchors
        assert "&id" not in text and "*id" not in text
        assert "config.yaml: |" in text  # the config, a block a person can read
        assert yaml.safe_load(docs[0]["data"]["config.yaml"])["train"]["max_steps"] == 4
        # the TrainJob under the comment that names the runtime it needs
        assert (f"---\n{runtime_comment('torch-distributed')}apiVersion: trainer" in text) == (
            kind == "trainjob"
        )


def test_an_elastic_jobs_config_keeps_its_batch_at_every_world_size(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("train: {max_steps: 4, batch_size: 16}\n")
    cfg = load_config(config)
    elastic = K8sSettings(image="img", kind="pytorchjob", nodes=2, min_nodes=1, procs_per_node=2)
    kept, lines = with_batch_plan(elastic, cfg, 2)
    # fixed at the largest world, 4
    assert kept.train.batch_size == 16 and kept.train.micro_batch_size == 4
    assert lines == [
        "4 ranks: global batch 16 = 4 replicas x micro-batch 4 x 1 accumulation step",
        "2 ranks: global batch 16 = 2 replicas x micro-batch 4 x 2 accumulation steps",
    ]
    fixed = K8sSettings(image="img", kind="pytorchjob", nodes=4, procs_per_node=2)
    assert with_batch_plan(fixed, cfg, 2) == (cfg, [])
