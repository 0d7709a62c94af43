"""`lockstep slurm`'s arguments (lockstep/cli/slurm.py): the script printed with --dry-run, KEY=VALUE pairs, and
a missing sbatch reported in one line. The script itself: tests/unit/launch/test_slurm.py."""

from __future__ import annotations

import argparse

from conftest import run_main

from lockstep.cli import slurm as slurm_cli

from ..launch.test_slurm import config  # noqa: F401  (the fixture, written once)


def cli(*argv: str) -> int:
    p = argparse.ArgumentParser()
    slurm_cli.add_arguments(p)
    return slurm_cli.run(p.parse_args(argv), list(argv))


def test_cli_dry_run_and_missing_sbatch(config, tmp_path, monkeypatch, capsys):  # noqa: F811
    assert cli(str(config), "--nodes", "2", "--procs-per-node", "2", "--dry-run") == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash\n#SBATCH --job-name=lockstep")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "bash").symlink_to("/bin/bash")  # bash stays, for the syntax check; sbatch is not there
    monkeypatch.setenv("PATH", str(bare))
    assert cli(str(config), "--nodes", "2", "--log-dir", str(tmp_path / "logs")) == 1
    assert "sbatch not found; use --dry-run to print the script" in capsys.readouterr().err


def test_help_lists_the_options(capsys):
    code, out, _ = run_main(capsys, "slurm", "--help")
    assert code == 0
    for option in (
        "--nodes N|MIN:MAX",
        "--nnodes",
        "--max-restarts",
        "--rdzv-conf KEY=VALUE",
        "--gpus-per-node",
        "--procs-per-node",
        "--cpus-per-task",
        "--time",
        "--partition",
        "--account",
        "--job-name",
        "--env-setup SHELL_LINE",
        "--env KEY=VALUE",
        "--log-dir",
        "--requeue",
        "--port",
        "--set KEY=VALUE",
        "--sbatch-arg DIRECTIVE",
        "--dry-run",
    ):
        assert option in out, option


def test_help_groups_the_training_flags_by_config_section(capsys):
    from lockstep.cli.train_flags import FLAGS, SECTIONS

    from .test_train_flags import help_sections

    code, out, _ = run_main(capsys, "slurm", "--help")
    sections = help_sections(out)
    headers = [h for h in sections if h.endswith("(training flags)")]
    assert code == 0 and headers == [f"{s} (training flags)" for s in SECTIONS]
    for flag, key in FLAGS.items():
        assert f"\n  {flag} " in sections[f"{key.split('.')[0]} (training flags)"], flag


def test_lightning_process_counts_point_to_the_job_size_flags(config, capsys):  # noqa: F811
    code, out, err = run_main(capsys, "slurm", config, "--num_nodes", "2", "--dry-run")
    assert (code, out) == (2, "")
    assert err == (
        "lockstep slurm: error: --num_nodes 2: `lockstep slurm` sizes the job with "
        "--nodes N; pass that instead\n"
    )
    code, _, err = run_main(capsys, "slurm", config, "--trainer.devices", "8", "--dry-run")
    assert err == (
        "lockstep slurm: error: --devices 8: `lockstep slurm` sizes the job with "
        "--gpus-per-node N (GPU workers) or --procs-per-node N (CPU workers); pass that "
        "instead\n"
    )
    code, out, err = run_main(capsys, "slurm", config, "--precision", "bf16-mixed", "--dry-run")
    assert code == 0 and out.rstrip().endswith("--set train.mixed_precision=bf16")


def test_settings_reach_the_script(config, tmp_path, capsys):  # noqa: F811
    code, out, err = run_main(
        capsys,
        "slurm",
        config,
        "--nodes",
        "2",
        "--job-name",
        "gpt",
        "--time",
        "01:00:00",
        "--env",
        "NCCL_DEBUG=INFO",
        "--set",
        "train.max_steps=9",
        "--sbatch-arg=--qos=high",
        "--log-dir",
        tmp_path / "logs",
        "--dry-run",
    )
    assert code == 0 and err == ""
    directives = [line for line in out.splitlines() if line.startswith("#SBATCH ")]
    assert {
        "#SBATCH --job-name=gpt",
        "#SBATCH --nodes=2",
        "#SBATCH --time=01:00:00",
        "#SBATCH --qos=high",
    } <= set(directives)
    assert '\nexport NCCL_DEBUG="INFO"\n' in out and out.rstrip().endswith(
        "--set train.max_steps=9"
    )
    assert not (tmp_path / "logs").exists()  # a dry run writes nothing


def test_pairs_that_are_not_key_value(config, capsys):  # noqa: F811
    for flag in ("--env", "--set"):
        assert run_main(capsys, "slurm", config, flag, "NOEQUALS", "--dry-run") == (
            2,
            "",
            f"lockstep slurm: error: {flag} 'NOEQUALS' is not KEY=VALUE; e.g. {flag} NCCL_DEBUG=INFO\n",
        )


def test_node_range_prints_the_batch_plan(config, capsys):  # noqa: F811
    """--nodes MIN:MAX: the script (stdout) is elastic, the batch plan at each world size goes to stderr."""
    code, out, err = run_main(
        capsys,
        "slurm",
        config,
        "--nodes",
        "1:2",
        "--procs-per-node",
        "2",
        "--max-restarts",
        "5",
        "--rdzv-conf",
        "last_call_timeout=10",
        "--dry-run",
    )
    assert code == 0 and out.startswith("#!/bin/bash\n")
    assert (
        "#SBATCH --no-kill" in out
        and '--nnodes "1:$SLURM_NNODES"' in out
        and "--max-restarts 5" in out
    )
    assert "is_host=$IS_HOST,last_call_timeout=10" in out
    assert err == (
        "lockstep slurm: elastic job; the batch plan at each world size:\n"
        "  4 ranks: global batch 16 = 4 replicas x micro-batch 4 x 1 accumulation step\n"
        "  2 ranks: global batch 16 = 2 replicas x micro-batch 4 x 2 accumulation steps\n"
    )


def test_a_store_node_of_its_own_from_the_flags(config, capsys):  # noqa: F811
    """--rdzv-store external --store-partition: a heterogeneous job (tests/unit/launch/test_slurm.py has
    its script); refused for a fixed node count, with the fix."""
    code, out, _ = run_main(
        capsys,
        *("slurm", config, "--nodes", "1:2", "--procs-per-node", "2", "--partition", "gpu"),
        *("--rdzv-store", "external", "--store-partition", "cpu", "--dry-run"),
    )
    assert code == 0 and "#SBATCH --partition=cpu\n#SBATCH hetjob\n#SBATCH --nodes=2\n" in out
    code, out, err = run_main(
        capsys, "slurm", config, "--nodes", "2", "--rdzv-store", "external", "--dry-run"
    )
    assert code == 2 and out == "" and "give --nodes a range" in err


def test_bad_node_ranges(config, capsys):  # noqa: F811
    code, out, err = run_main(capsys, "slurm", config, "--nodes", "2:1", "--dry-run")
    assert (code, out) == (
        2,
        "",
    ) and "--nnodes 2:1: MIN(2) must be at least 1 and at most MAX(1)" in err
    code, _, err = run_main(capsys, "slurm", config, "--nnodes", "two", "--dry-run")
    assert code == 2 and "is not a node count N or a range MIN:MAX" in err
    code, _, err = run_main(
        capsys, "slurm", config, "--nodes", "2:4", "--procs-per-node", "2", "--dry-run"
    )
    # 16 over 4, 6, 8
    assert code == 2 and "cannot be kept at every world size" in err and "at 6 ranks" in err


def test_cpus_per_task_flag_and_default(config, tmp_path, monkeypatch, capsys):  # noqa: F811
    """--cpus-per-task N reaches the directive and OMP_NUM_THREADS; without it the script still asks for CPUs (here
    with no sinfo on PATH: 2 CPU workers x max(1, 1 + 1 for data.num_workers auto) = 4), and says
    where it comes from."""
    code, out, _ = run_main(
        capsys,
        "slurm",
        config,
        "--nodes",
        "2",
        "--procs-per-node",
        "2",
        "--cpus-per-task",
        "16",
        "--dry-run",
    )
    assert (
        code == 0 and "#SBATCH --cpus-per-task=16\n" in out and 'export OMP_NUM_THREADS="8"' in out
    )
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "bash").symlink_to("/bin/bash")
    monkeypatch.setenv("PATH", str(bare))
    code, out, _ = run_main(
        capsys, "slurm", config, "--nodes", "2", "--procs-per-node", "2", "--dry-run"
    )
    assert (
        code == 0 and "#SBATCH --cpus-per-task=4\n" in out and 'export OMP_NUM_THREADS="2"' in out
    )
    assert (
        "# --cpus-per-task=4: 2 CPU worker(s) x 2 CPUs = "
        "max(1, 1 + 1 for data.num_workers auto) each"
    ) in out
    code, out, err = run_main(
        capsys, "slurm", config, "--procs-per-node", "4", "--cpus-per-task", "2", "--dry-run"
    )
    assert (
        (code, out) == (2, "")
        and "cpus_per_task(2) < processes per node(4)" in err
        and "at least 4" in err
    )
