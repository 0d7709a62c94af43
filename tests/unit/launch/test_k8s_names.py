"""Job names against the longest name each operator derives from them: the boundary, exactly, per node count."""

from __future__ import annotations

import pytest

from lockstep.errors import ConfigError
from lockstep.launch.k8s_names import check_job_name, derived_names, longest_job_name


@pytest.mark.parametrize(
    "kind, nodes, elastic, longest, derived",
    [
        ("pytorchjob", 1, False, 54, "-master-0"),  # 54 + len("-master-0") = 63
        ("pytorchjob", 2, False, 54, "-master-0"),  # worker-0 is as long; the first is named
        ("pytorchjob", 11, False, 54, "-master-0"),  # 10 Workers: worker-0..worker-9
        ("pytorchjob", 12, False, 53, "-worker-10"),
        ("pytorchjob", 11, True, 53, "-worker-10"),  # elastic: Workers only, all 11 of them
        ("trainjob", 1, False, 48, "-node-0-0-abcde"),  # the pod name JobSet's webhook checks
        ("trainjob", 10, False, 48, "-node-0-9-abcde"),
        ("trainjob", 11, False, 47, "-node-0-10-abcde"),
        ("trainjob", 101, False, 46, "-node-0-100-abcde"),
        ("indexed", 1, False, 61, "-0"),
        ("indexed", 11, False, 60, "-10"),
    ],
)
def test_longest_name_that_fits(kind, nodes, elastic, longest, derived):
    assert longest_job_name(kind, nodes, elastic) == longest
    fits, too_long = "g" * longest, "g" * (longest + 1)
    check_job_name(kind, fits, nodes, elastic)  # the longest accepted name
    assert max(len(d) for d, _ in derived_names(kind, fits, nodes, elastic)) == 63
    with pytest.raises(ConfigError) as e:  # the shortest refused one
        check_job_name(kind, too_long, nodes, elastic)
    message = str(e.value)
    assert f"'{too_long}{derived}', 64 characters" in message
    assert "at most 63 characters in a DNS label" in message
    assert f"the job name may have at most {longest} characters, e.g. --name {fits}" in message


def test_the_old_check_let_these_through():
    """55 characters passed `<name>-config` <= 63; the operator's `<name>-master-0` is then 64."""
    with pytest.raises(ConfigError, match="'a{55}-master-0', 64 characters"):
        check_job_name("pytorchjob", "a" * 55, 1)
    with pytest.raises(ConfigError, match="the last node's pod"):
        check_job_name("trainjob", "a" * 56, 2)


@pytest.mark.parametrize("name", ["GPT", "gpt_run", "1gpt", "gpt-", "", "gpt.run"])
def test_not_a_dns_label(name):
    with pytest.raises(ConfigError, match=f"name = '{name}' must be a DNS label"):
        check_job_name("trainjob", name, 1)


def test_suggested_name_drops_a_trailing_dash():
    name = "a" * 47 + "-" + "b" * 5  # cut at 48 characters it would end in '-'
    with pytest.raises(ConfigError, match=r"e.g. --name a{47}$"):
        check_job_name("trainjob", name, 2)
    with pytest.raises(ConfigError, match="is not one of 'trainjob', 'pytorchjob', 'indexed'"):
        derived_names("mpijob", "gpt", 2)
