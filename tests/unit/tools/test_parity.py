"""lockstep/tools/parity.py without the runs (those: tests/e2e/test_parity.py): the per-step losses read from a
run's metrics.jsonl as the trainer writes it, the differences, the verdict against the tolerance, and the report;
the reference config that every layout shares, and what `--reference DIR` refuses before anything
runs (the parity runs with --reference: tests/e2e/test_train_parallel.py)."""

from __future__ import annotations

import math

import pytest

from lockstep.config import config_to_dict, load_config
from lockstep.errors import ConfigError
from lockstep.metrics import MetricsWriter
from lockstep.tools.parity import (
    ParityReport,
    ParityStep,
    _step_losses,
    parity_configs,
    reference_losses,
    run_parity,
    write_run_config,
)


def test_step_losses_are_the_train_losses_of_a_run(tmp_path):
    writer = MetricsWriter(tmp_path, is_main=True, total_steps=3, tensorboard=False, progress=False)
    writer.log(1, {"loss": 2.5, "lr": 1e-3})
    writer.log(2, {"loss": 2.25, "tokens_per_s": 900.0})
    writer.log(2, {"loss": 9.0}, split="eval")  # an evaluation: not a training step's loss
    writer.log(3, {"lr": 1e-3})  # no loss logged at this step
    writer.close()
    assert _step_losses(tmp_path) == {1: 2.5, 2: 2.25}


def test_differences_and_the_verdict():
    step = ParityStep(4, reference=2.0, parallel=2.0005)
    assert step.abs_diff == pytest.approx(5e-4) and step.rel_diff == pytest.approx(2.5e-4)
    # no division by zero
    assert ParityStep(1, reference=0.0, parallel=1e-13).rel_diff == pytest.approx(0.1)
    steps = [ParityStep(1, 3.0, 3.0), step]
    assert ParityReport(2, "ddp", steps, tolerance=1e-3).ok
    assert ParityReport(2, "ddp", steps, tolerance=1e-3).max_rel_diff == pytest.approx(2.5e-4)
    assert not ParityReport(2, "ddp", steps, tolerance=1e-4).ok
    empty = ParityReport(2, "ddp", [], tolerance=1.0)  # no step in common: nothing was compared
    assert empty.max_rel_diff == math.inf and not empty.ok


def test_report_lines():
    report = ParityReport(
        4, "fsdp(4)", [ParityStep(1, 3.0, 3.0), ParityStep(2, 2.0, 2.0005)], tolerance=1e-4
    )
    assert report.format().splitlines() == [
        "parity: 1 process vs 4 (fsdp(4)), 2 steps",
        "step  loss (1 proc)  loss (N procs)  abs diff   rel diff",
        "   1       3.000000        3.000000  0.00e+00  0.00e+00",
        "   2       2.000000        2.000500  5.00e-04  2.50e-04",
        "max relative difference 2.50e-04: OUTSIDE the tolerance 0.0001",
    ]


def test_a_reused_reference_is_named_in_the_report():
    steps = [ParityStep(1, 3.0, 3.0)]
    report = ParityReport(2, "tp(2)", steps, 1e-4, "/runs/a/parity/reference", reused=True)
    assert report.format().splitlines()[:2] == [
        "parity: 1 process vs 2 (tp(2)), 1 steps",
        "reference: /runs/a/parity/reference (an earlier run's: not trained again)",
    ]


# the layouts of tests/e2e/test_train_parallel.py as dotted keys: (world size, overrides)
TINY = {
    "model.hidden_size": 32,
    "model.attention_heads": 2,
    "model.layers": 2,
    "model.max_seq_length": 32,
    "train.batch_size": 8,
    "train.mixed_precision": "no",
    "data.path": "corpus.txt",
}
PP = {"parallel.pipeline_parallel": 2, "train.grad_accum": 2}
LAYOUTS = [
    (2, {"parallel.data_parallel": "fsdp", "train.grad_accum": 2}),
    (2, {"parallel.tensor_parallel": 2}),
    (2, {**PP, "parallel.pipeline_schedule": "1f1b"}),
    (2, {**PP, "parallel.pipeline_schedule": "gpipe"}),
    (
        4,
        {
            "parallel.data_parallel": "fsdp",
            "parallel.tensor_parallel": 2,
            "parallel.fsdp_reshard_after_forward": False,
        },
    ),
]
FIX = "or drop --reference to train the 1-process reference"


def _reference(tmp_path, layout: dict, world: int = 2, steps: int = 3, **more):
    """The reference config that `lockstep parity` builds for this layout, under tmp_path/parity."""
    cfg = load_config(None, {**TINY, **layout, **more})
    return parity_configs(cfg, world, steps, tmp_path / "parity")[0]


def _losses(run_dir, steps: int) -> None:
    writer = MetricsWriter(
        run_dir, is_main=True, total_steps=steps, tensorboard=False, progress=False
    )
    for step in range(1, steps + 1):
        writer.log(step, {"loss": 5.0 - step / 10})
    writer.close()


def _reference_run(run_dir, reference, steps: int):
    """A reference run's folder as `lockstep parity` leaves it: its config, its losses."""
    write_run_config(reference, run_dir)
    _losses(run_dir, steps)
    return run_dir


def test_every_layout_has_the_same_reference(tmp_path):
    # one reference run serves every layout: the 1-process config drops what a layout sets
    refs = [config_to_dict(_reference(tmp_path, layout, world)) for world, layout in LAYOUTS]
    assert all(ref == refs[0] for ref in refs[1:])
    par = refs[0]["parallel"]
    assert (par["data_parallel"], par["tensor_parallel"], par["pipeline_parallel"]) == ("ddp", 1, 1)
    assert refs[0]["train"]["grad_accum"] is None and refs[0]["train"]["max_steps"] == 3
    assert refs[0]["checkpoint"]["output_dir"] == str(tmp_path / "parity" / "reference")


def test_an_earlier_reference_with_the_same_config_is_accepted(tmp_path):
    # trained for the fsdp layout in another output folder, reused for pp with gpipe
    earlier = _reference_run(
        tmp_path / "a" / "parity" / "reference", _reference(tmp_path / "a", LAYOUTS[0][1]), 3
    )
    reference = _reference(tmp_path / "b", LAYOUTS[3][1])
    assert reference_losses(reference, earlier, 3) == {1: 4.9, 2: 4.8, 3: pytest.approx(4.7)}


def test_a_reference_folder_without_its_files_is_refused(tmp_path):
    reference = _reference(tmp_path, {})
    folder = tmp_path / "earlier"
    rule = (
        "--reference takes the parity/reference folder of an earlier `lockstep parity` (it "
        f"holds parity-config.yaml and metrics.jsonl): pass that folder, {FIX}"
    )
    with pytest.raises(ConfigError) as e:
        reference_losses(reference, folder, 3)  # no folder at all
    assert str(e.value) == f"--reference {folder}: no parity-config.yaml there; {rule}"
    write_run_config(reference, folder)
    with pytest.raises(ConfigError) as e:
        reference_losses(reference, folder, 3)
    assert str(e.value) == f"--reference {folder}: no metrics.jsonl there; {rule}"
    (folder / "parity-config.yaml").unlink()
    _losses(folder, 3)
    with pytest.raises(ConfigError) as e:
        reference_losses(reference, folder, 3)
    assert str(e.value) == f"--reference {folder}: no parity-config.yaml there; {rule}"


def test_a_reference_with_another_config_is_refused_naming_the_keys(tmp_path):
    earlier = _reference_run(tmp_path / "earlier", _reference(tmp_path, {}, **{"train.seed": 7}), 3)
    with pytest.raises(ConfigError) as e:
        reference_losses(_reference(tmp_path, {}), earlier, 3)
    assert str(e.value) == (
        f"--reference {earlier} trained another config than this comparison's reference: "
        "train.seed = 7 there, 1337 here; the reference must be the run this parity would train "
        "(same model, data, seed, steps and global batch; only its output_dir may differ): pass "
        f"the options of that run, {FIX}"
    )
    # --steps is part of the config: a reference of 3 steps is not one of 5; the first 3 keys
    # are named, the 4th (train.seed) counted
    other = _reference(tmp_path, {}, steps=5, **{"optim.learning_rate": 1e-2, "model.layers": 4})
    with pytest.raises(ConfigError) as e:
        reference_losses(other, earlier, 5)
    assert str(e.value).startswith(
        f"--reference {earlier} trained another config than this comparison's reference: "
        "model.layers = 2 there, 4 here; optim.learning_rate = "
    )
    assert "; train.max_steps = 3 there, 5 here (and 1 more keys); the reference" in str(e.value)


def test_a_reference_that_did_not_finish_is_refused(tmp_path):
    reference = _reference(tmp_path, {}, steps=4)
    earlier = _reference_run(tmp_path / "earlier", reference, 2)  # stopped after step 2 of 4
    with pytest.raises(ConfigError) as e:
        reference_losses(reference, earlier, 4)
    assert str(e.value) == (
        f"--reference {earlier} logged the loss of 2 of the --steps 4 steps (none at step 3): the "
        "reference needs every step compared, and that run did not finish (see its logs/): pass a "
        f"finished one, {FIX}"
    )


def test_run_parity_refuses_a_wrong_reference_before_anything_runs(tmp_path):
    cfg = load_config(None, {**TINY, "parallel.tensor_parallel": 2})
    out = tmp_path / "run" / "parity"
    with pytest.raises(ConfigError, match="no parity-config.yaml there"):
        run_parity(cfg, 2, 3, out, 1e-4, reference_dir=tmp_path / "nothing")
    assert not out.exists()


def test_a_reference_config_that_is_no_config_is_refused(tmp_path):
    reference = _reference(tmp_path, {})
    folder = _reference_run(tmp_path / "earlier", reference, 3)
    config_file = folder / "parity-config.yaml"
    config_file.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        reference_losses(reference, folder, 3)
    assert str(e.value).startswith(f"--reference {folder}: {config_file} is not valid YAML: ")
    assert str(e.value).endswith(f"; {FIX}")
    config_file.write_text("- a list\n- of things\n")
    with pytest.raises(ConfigError) as e:
        reference_losses(reference, folder, 3)
    assert str(e.value) == (
        f"--reference {folder}: {config_file} holds no mapping of config sections; {FIX}"
    )


def test_a_run_that_fails_names_its_log(tmp_path):
    # a real `lockstep train` that fails at once: its corpus does not exist
    from lockstep.tools.parity import _train

    cfg = load_config(None, {**TINY, "data.path": str(tmp_path / "missing.txt")})
    log = tmp_path / "reference.log"
    with pytest.raises(RuntimeError) as e:
        _train(cfg, 1, tmp_path / "reference", log)
    assert str(e.value) == f"the 1-process run failed (exit 1); see {log}"
    assert "missing.txt' does not exist" in log.read_text()
