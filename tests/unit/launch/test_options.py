"""lockstep/launch/options.py: a job's node range, restarts and rendezvous settings, one rule set for every
launcher: each refusal with the value, the rule and the fix; the one default of the restarts."""

from __future__ import annotations

import pytest

from lockstep.errors import ConfigError
from lockstep.launch.options import (
    ELASTIC_RESTARTS,
    LaunchOptions,
    check_elastic,
    launch_options,
    parse_nnodes,
    parse_rdzv_conf,
)


def test_a_fixed_job_restarts_never_and_a_range_three_times_unless_told():
    assert launch_options() == LaunchOptions(1, 1, 0, {})
    fixed = launch_options("4", rdzv_conf=["join_timeout=300"])
    assert (fixed.min_nodes, fixed.nodes, fixed.max_restarts, fixed.elastic, fixed.spec) == (
        4,
        4,
        0,
        False,
        "4",
    )
    assert fixed.rdzv_conf == {"join_timeout": "300"}
    elastic = launch_options("1:3", rdzv_conf=[" last_call_timeout = 10 "])
    assert (elastic.min_nodes, elastic.nodes, elastic.max_restarts, elastic.spec) == (
        1,
        3,
        ELASTIC_RESTARTS,
        "1:3",
    )
    assert elastic.elastic and elastic.rdzv_conf == {"last_call_timeout": "10"}
    assert launch_options(2, max_restarts=5).max_restarts == 5
    # what the Slurm and Kubernetes settings take: min_nodes only for a range
    assert elastic.as_settings() == {"nodes": 3, "min_nodes": 1, "max_restarts": 3,
                                     "rdzv_conf": {"last_call_timeout": "10"}}  # fmt: skip
    assert fixed.as_settings()["min_nodes"] is None
    assert (
        check_elastic(None, 2, None, {}) == 0
        and check_elastic(1, 2, None, {}) == ELASTIC_RESTARTS == 3
    )
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:2") == (1, 2)


@pytest.mark.parametrize(
    "nnodes, restarts, conf, message",
    [
        (
            "0",
            None,
            [],
            "--nnodes 0: MIN(0) must be at least 1 and at most MAX(0); write MIN:MAX with 1 <= MIN <= MAX",
        ),
        ("3:2", None, [], "--nnodes 3:2: MIN(3) must be at least 1 and at most MAX(2)"),
        (
            "two",
            None,
            [],
            "--nnodes 'two' is not a node count N or a range MIN:MAX (e.g. 2, or 1:2)",
        ),
        ("2", -1, [], "--max-restarts -1 must be >= 0"),
        (
            "1:2",
            0,
            [],
            "--nnodes 1:2 with --max-restarts 0: the nodes left after a failure re-form the group in a "
            "restart; pass --max-restarts 1 or more (the default for a range is 3)",
        ),
        ("1:2", None, ["last_call_timeout"], "--rdzv-conf 'last_call_timeout' is not KEY=VALUE"),
        ("1:2", None, ["=5"], "--rdzv-conf '=5' is not KEY=VALUE"),
        # the one rule set: a timeout is a whole number of seconds wherever it is given (it was text to one CLI)
        (
            "1:2",
            None,
            ["last_call_timeout=abc"],
            "last_call_timeout must be a whole number of seconds (or attempts) "
            "above 0, e.g. last_call_timeout=10",
        ),
        ("1:2", None, ["keep_alive_interval=0"], "keep_alive_interval must be a whole number"),
        (
            "1:2",
            None,
            ["last_call_timeout=5 s"],
            "--rdzv-conf last_call_timeout='5 s': expected KEY=VALUE with a plain value",
        ),
        # lockstep decides which node hosts the store (one CLI overwrote the user's value, another refused it)
        ("2", None, ["is_host=1"], "--rdzv-conf is_host: lockstep sets it per node"),
    ],
)
def test_each_refusal_names_the_value_the_rule_and_the_fix(nnodes, restarts, conf, message):
    with pytest.raises(ConfigError) as e:
        launch_options(nnodes, restarts, conf)
    assert message in str(e.value)


def test_the_renderers_settings_are_checked_by_the_same_rules():
    with pytest.raises(ConfigError, match="lockstep sets it per node"):
        check_elastic(1, 2, None, {"is_host": "0"})
    with pytest.raises(ConfigError, match="must be a whole number of seconds"):
        check_elastic(None, 2, None, {"join_timeout": "x"})
    assert parse_rdzv_conf([]) == {}
