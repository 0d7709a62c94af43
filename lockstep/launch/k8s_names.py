"""The names Kubernetes operators derive from a job's name, and the check that every one of them is valid.

A job name that is itself a valid DNS label can still fail once an operator appends its suffixes: a Service or
pod host name over 63 characters is refused by the API server, and the job never starts. What each kind derives
(read from the operators' source):
- `pytorchjob` (training-operator v1.9): a pod and a Service per replica, `<name>-master-0` and
  `<name>-worker-<i>` (GenGeneralName); an elastic job has Workers only.
- `trainjob` (Kubeflow Trainer v2 on JobSet v0.12): the JobSet `<name>`, its Job `<name>-node-0` (GenJobName), and
  pods whose host names are `<name>-node-0-<i>`; JobSet's admission webhook refuses a JobSet unless the longest pod
  name, that host name plus the Job controller's 5-character random suffix (`-abcde`), is a DNS-1035 label.
- `indexed` (a plain Indexed Job): pod host names `<name>-<i>` under the headless Service `<name>`.
The ConfigMap `<name>-config` is an object name (a DNS subdomain, up to 253 characters).
"""

from __future__ import annotations

import re

from lockstep.errors import ConfigError

LABEL_MAX = 63  # DNS label (RFC 1035 / 1123): Service names, pod host names, label values
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# stands for the Job controller's random pod-name suffix: 5 characters after a '-'
POD_SUFFIX = "-abcde"


def derived_names(kind: str, name: str, nodes: int, elastic: bool = False) -> list[tuple[str, str]]:
    """(derived name, what it names) for every name the operator makes from `name` that must be a DNS label."""
    match kind:
        case "pytorchjob":
            if elastic:
                return [(f"{name}-worker-{nodes - 1}", "the last Worker's pod and Service")]
            out = [(f"{name}-master-0", "the Master's pod and Service")]
            if nodes > 1:  # Worker replicas are nodes - 1, numbered from 0
                out.append((f"{name}-worker-{nodes - 2}", "the last Worker's pod and Service"))
            return out
        case "trainjob":
            return [
                (name, "the JobSet and its headless Service"),
                (f"{name}-node-0", "the JobSet's Job"),
                (
                    f"{name}-node-0-{nodes - 1}{POD_SUFFIX}",
                    "the last node's pod (host name plus the Job controller's 5-character suffix, "
                    "as JobSet's webhook checks it)",
                ),
            ]
        case "indexed":
            return [
                (name, "the headless Service"),
                (f"{name}-{nodes - 1}", "the last pod's host name"),
            ]
        case _:
            raise ConfigError(f"kind = {kind!r} is not one of 'trainjob', 'pytorchjob', 'indexed'")


def longest_job_name(kind: str, nodes: int, elastic: bool = False) -> int:
    """The most characters a job name may have so that every derived name fits a DNS label."""
    suffix = max(len(derived) for derived, _ in derived_names(kind, "", nodes, elastic))
    return LABEL_MAX - suffix


def check_job_name(kind: str, name: str, nodes: int, elastic: bool = False) -> None:
    """Refuse a name that is no DNS-1035 label, or that some derived name would push past 63 characters."""
    if not DNS_1035_LABEL.fullmatch(name):
        raise ConfigError(
            f"name = {name!r} must be a DNS label (lowercase letters, digits, '-', starting with a "
            "letter, ending with a letter or digit) of at most 63 characters; e.g. --name gpt-run1"
        )
    derived, what = max(derived_names(kind, name, nodes, elastic), key=lambda pair: len(pair[0]))
    if len(derived) > LABEL_MAX:
        fit = longest_job_name(kind, nodes, elastic)
        raise ConfigError(
            f"name = {name!r} ({len(name)} characters) is too long for a {nodes}-node {kind}: the operator names "
            f"{what} {derived!r}, {len(derived)} characters, and Kubernetes allows at most {LABEL_MAX} characters in "
            f"a DNS label; at {nodes} node(s) the job name may have at most {fit} characters, e.g. --name "
            f"{name[:fit].rstrip('-')}"
        )
