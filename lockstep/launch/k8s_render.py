"""The manifests of a Kubernetes job as one YAML stream (lockstep.launch.k8s builds each object): the ConfigMap
with the config an elastic job keeps at every world size, an elastic job's rendezvous store (Service
and Job: lockstep.launch.k8s_store), then the TrainJob, PyTorchJob or Indexed Job."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import yaml
from kubernetes import client

from lockstep.config import Config
from lockstep.launch.k8s import (
    K8sSettings,
    build_config_map,
    build_indexed_job,
    build_k8s_trainjob,
    build_pytorchjob,
    check_settings,
    external_store,
)
from lockstep.launch.k8s_store import build_store
from lockstep.launch.options import elastic_plan
from lockstep.launch.trainjob import runtime_comment


def with_batch_plan(s: K8sSettings, cfg: Config, nproc: int) -> tuple[Config, list[str]]:
    """The config the ConfigMap holds: for an elastic job, with the global batch and micro-batch that every world
    size in the range keeps (accumulation worked out per size); and the batch plan at each size, one line each."""
    overrides, lines = elastic_plan(
        cfg, s.min_nodes if s.min_nodes is not None else s.nodes, s.nodes, nproc
    )
    if overrides:
        train = {key.removeprefix("train."): value for key, value in overrides.items()}
        assert len(train) == len(overrides), f"batch plan overrides outside train: {overrides}"
        cfg = replace(cfg, train=replace(cfg.train, **train))
    return cfg, lines


def render_manifests(s: K8sSettings, cfg: Config) -> list[dict[str, Any]]:
    """The objects to apply, as plain dicts, in apply order."""
    nproc = check_settings(s, cfg)
    cfg, _ = with_batch_plan(s, cfg, nproc)
    api = client.ApiClient()
    docs: list[dict[str, Any]] = [api.sanitize_for_serialization(build_config_map(s, cfg))]
    if external_store(s):  # up before the workers look for it
        docs += [
            api.sanitize_for_serialization(o) for o in build_store(s.name, s.namespace, s.image)
        ]
    if s.kind == "trainjob":
        docs.append(build_k8s_trainjob(s, nproc))
    elif s.kind == "pytorchjob":
        docs.append(build_pytorchjob(s, nproc))
    else:
        docs += [api.sanitize_for_serialization(obj) for obj in build_indexed_job(s, nproc)]
    return docs


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config in the ConfigMap) as readable `|` blocks; no `&id` anchors for the
    pod template that Master and Worker share (kubectl reads them, people reading the file trip on them)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None),
)


def render_yaml(s: K8sSettings, cfg: Config) -> str:
    """The manifests as one YAML stream; a TrainJob comes after a comment that names the runtime it needs."""
    docs = []
    for doc in render_manifests(s, cfg):
        text = yaml.dump(doc, Dumper=_Dumper, sort_keys=False)
        if doc["kind"] == "TrainJob":
            text = runtime_comment(s.runtime) + text
        docs.append(text)
    return "---\n".join(docs)
