"""`lockstep launch`'s arguments (lockstep/cli/launch.py): nodes, processes and --set overrides checked against
the config before any worker starts. Launches: tests/e2e/test_launch.py."""

from __future__ import annotations

import pytest
from conftest import busy_port, run_main

from lockstep.cli import build_parser


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"train: {{max_steps: 4, batch_size: 16}}\ncheckpoint: {{output_dir: '{tmp_path / 'run'}'}}\n"
    )
    return path


def test_help_and_defaults(capsys):
    code, out, _ = run_main(capsys, "launch", "--help")
    assert code == 0
    for option in (
        "--nproc",
        "--nnodes N|MIN:MAX",
        "--node-rank",
        "--rdzv-endpoint HOST:PORT",
        "--rdzv-id",
        "--rdzv-timeout",
        "--max-restarts",
        "--rdzv-conf KEY=VALUE",
        "--set KEY=VALUE",
    ):
        assert option in out, option
    parser, _ = build_parser()
    args = parser.parse_args(
        ["launch", "run.yaml", "--set", "train.max_steps=9", "--set", "train.seed=2"]
    )
    assert (
        args.config,
        args.nproc,
        args.nnodes,
        args.node_rank,
        args.rdzv_timeout,
        args.max_restarts,
    ) == ("run.yaml", None, "1", None, 120.0, None)
    assert args.sets == ["train.max_steps=9", "train.seed=2"]


def test_refused_before_any_worker_starts(config, tmp_path, capsys):
    cases = [
        (["--nproc", "-1"], "--nproc -1 must be at least 1"),
        (["--nproc", "0"], "--nproc 0 must be at least 1"),  # refused, not read as "the default"
        (
            ["--nnodes", "0"],
            "--nnodes 0: MIN(0) must be at least 1 and at most MAX(0); write MIN:MAX with 1 <= MIN "
            "<= MAX, e.g. 1:2",
        ),
        (
            ["--nnodes", "2:1"],
            "--nnodes 2:1: MIN(2) must be at least 1 and at most MAX(1); write MIN:MAX with 1 <= "
            "MIN <= MAX, e.g. 1:2",
        ),
        (
            ["--nnodes", "two"],
            "--nnodes 'two' is not a node count N or a range MIN:MAX (e.g. 2, or 1:2)",
        ),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is not in 0..1 (--nnodes 2)"),
        (["--nnodes", "1:3", "--node-rank", "3"], "--node-rank 3 is not in 0..2 (--nnodes 1:3)"),
        (
            ["--nnodes", "1:2", "--set", "distributed.world_size=2"],
            "nnodes(1:2) x nproc(1) = 1..2 != distributed.world_size(2); change one, or drop world_size from the config",
        ),
        (
            ["--nnodes", "1:2", "--rdzv-conf", "last_call_timeout"],
            "--rdzv-conf 'last_call_timeout' is not KEY=VALUE (e.g. last_call_timeout=10)",
        ),
        (
            ["--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=0"],
            "--rdzv-conf last_call_timeout=0: last_call_timeout must be a whole number of seconds (or attempts) above 0, "
            "e.g. last_call_timeout=10",
        ),
        # an elastic job keeps its global batch at every world size it may run at, or is refused with the fix
        (
            ["--nnodes", "2:3", "--nproc", "2", "--set", "train.batch_size=12"],
            "global batch 12 (micro-batch 2, fixed at the largest world size, 6) cannot be kept at every world size this "
            "job may run at (4, 6):\nat 4 ranks: global batch 12 is not divisible by world_size(4) x "
            "micro_batch_size(2) = 8; set train.batch_size to a multiple of 8\nset train.batch_size to a multiple of 24, "
            "or narrow --nnodes MIN:MAX to the world sizes that work: 6\n",
        ),
        (
            ["--nnodes", "2:3", "--nproc", "2"],
            "at 6 ranks, the largest world size this job may run at: global batch 16 "
            "is not divisible by world_size(6) x grad_accum(1) = 6",
        ),
        # --set reaches the config the check reads
        (
            ["--nproc", "2", "--set", "distributed.world_size=3"],
            "nnodes(1) x nproc(2) = 2 != distributed.world_size(3); change one, or drop world_size from the config",
        ),
        (
            ["--nproc", "3"],
            "global batch 16 is not divisible by world_size(3) x grad_accum(1) = 3; set "
            "train.batch_size to a multiple of 3",
        ),
        # the endpoint's port rule, before the config's checks and the batch plan print anything
        (
            ["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:99999"],
            "--rdzv-endpoint '127.0.0.1:99999': port '99999' is not a TCP port; ports are 1-65535, e.g. 127.0.0.1:29500",
        ),
    ]
    for argv, message in cases:
        code, out, err = run_main(capsys, "launch", config, *argv)
        assert code == 2 and out == "" and err.startswith(f"lockstep launch: error: {message}"), (
            argv,
            err,
        )
        assert err.count("\n") == 1 or "cannot be kept" in message
    assert not (tmp_path / "run").exists()
    code, _, err = run_main(capsys, "launch", tmp_path / "nope.yaml")
    assert code == 2 and err == (
        f"lockstep launch: error: config file '{tmp_path / 'nope.yaml'}' does not exist; pass "
        "an existing YAML file\n"
    )


def test_an_elastic_job_is_checked_at_its_fewest_ranks_with_the_batch_it_will_run(
    config, tmp_path, capsys
):
    """~26B parameters (tests/unit/plan/test_check.py's HUGE): more than this machine holds at 2
    ranks; checked as the workers would run it (global batch 4, micro-batch 1 fixed at 4 ranks)."""
    huge = ["model.hidden_size=32768", "model.attention_heads=256", "model.layers=2"]
    huge += ["model.max_seq_length=16", "train.batch_size=4", "train.plan_check=refuse"]
    sets = [a for s in huge for a in ("--set", s)]
    code, out, err = run_main(capsys, "launch", config, "--nnodes", "1:2", "--nproc", "2", *sets)
    assert (
        code == 2 and "2 ranks: global batch 4 = 2 replicas x micro-batch 1 x 2 accumulation" in out
    ), out
    assert err.startswith(
        "lockstep launch: error: at 2 ranks, the fewest this job may run at: lockstep plan: a step "
        "of this run needs "
    ), err
    assert "to start anyway: --set train.plan_check=warn (or off)" in err
    assert not (tmp_path / "run").exists()


def write_config(path, run, corpus, cache, *extra: str):
    """A tiny model's 6-step job (tests/e2e/test_launch.py's config), `extra` YAML lines after."""
    lines = [
        "model: {hidden_size: 32, attention_heads: 2, layers: 2, max_seq_length: 32}",
        "train: {max_steps: 6, batch_size: 8, sample_tokens: 0, log_interval: 1, "
        "peak_flops: 1.0e12, plots: false}",
        f"data: {{num_workers: 0, path: '{corpus}', cache_dir: '{cache}'}}",
        f"checkpoint: {{output_dir: '{run}', save_interval: 3}}",
        *extra,
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_launch_settings_in_a_config_file_and_a_taken_rendezvous_port(
    tmp_path, corpus, token_cache, capsys
):
    cfg = write_config(
        tmp_path / "c.yaml", tmp_path / "run", corpus, token_cache, "distributed: {world_size: 3}"
    )
    code, _, err = run_main(capsys, "launch", cfg, "--nproc", "2")
    assert code == 2 and "nnodes(1) x nproc(2) = 2 != distributed.world_size(3)" in err
    sock, port = busy_port()
    with sock:
        cfg = write_config(tmp_path / "d.yaml", tmp_path / "run", corpus, token_cache)
        code, _, err = run_main(
            capsys,
            "launch",
            cfg,
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
        )
        assert code == 2 and f"rendezvous port {port} on 127.0.0.1 is already in use" in err
        assert "--rdzv-endpoint HOST:PORT" in err and "--master-port" not in err
        assert not (tmp_path / "run" / "logs").exists()  # refused before the run dir gets a log
    code, out, err = run_main(
        capsys,
        "launch",
        cfg,
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--rdzv-endpoint",
        "127.0.0.1:99999",
    )
    assert (
        code == 2
        and err.strip().splitlines()[-1]
        == (
            "lockstep launch: error: --rdzv-endpoint '127.0.0.1:99999': port '99999' is not a TCP "
            "port; ports are 1-65535, e.g. 127.0.0.1:29500"
        )
        and out == ""
    )  # before any worker
