"""Is a checkpoint dir intact and usable (lockstep/checkpoint/verify.py), on real files: sizes and checksums, the
contents a resume relies on (the safetensors header, state.json's fields and types, pickles the weights-only
loader accepts and of the right shape), the quick check of sizes only, and the content check of DCP files that
the caller passes in."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from conftest import one_process

from lockstep.checkpoint.open import load_checkpoint, verify_checkpoint
from lockstep.checkpoint.plain import load_pickled_weights_only, save_checkpoint
from lockstep.checkpoint.report import verify_report
from lockstep.checkpoint.resume import resolve_resume
from lockstep.checkpoint.verify import (
    checkpoint_problems,
    quick_check,
    read_tensor_shapes,
    refusal_reason,
)
from lockstep.errors import CheckpointError

from .on_disk import powersgd_state, reseal, save, save_run_state, tensors, truncate


def test_checksum_mismatch_and_bad_contents_reported(tmp_path):
    path = save(tmp_path, 1)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    (path / "model.safetensors").write_bytes(bytes(data))
    assert verify_checkpoint(path) == ["model.safetensors: checksum mismatch"]

    path = save(tmp_path, 2)
    (path / "manifest.json").unlink()
    (path / "state.json").write_text("{not json")
    (path / "model.safetensors").write_bytes(b"\x00" * 7)
    problems = verify_checkpoint(path)
    assert any(p.startswith("manifest.json: missing") for p in problems)
    assert any(p.startswith("state.json: not JSON") for p in problems)
    assert any(p.startswith("model.safetensors: safetensors header unreadable") for p in problems)
    assert verify_checkpoint(tmp_path / "nope") == [f"{tmp_path / 'nope'}: no such directory"]


# A pickle payload that would create a file if torch.load ever executed it.
def _touch(path):
    Path(path).write_text("executed")


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (self.marker,))


TOUCH = f"{_touch.__module__}._touch"  # the global the payload names, as the refusals quote it


def test_optimizer_pickle_payload_rejected(tmp_path):
    marker = tmp_path / "pwned"
    path = save_checkpoint(
        tmp_path / "run", 1, tensors(), {"state": {}, "hook": Evil(str(marker))}, None, {}
    )
    # intact on disk: the content is what is refused, and verify says so
    problems = verify_checkpoint(path)
    assert len(problems) == 1 and problems[0].startswith(
        "optimizer.pt: torch.load(weights_only=True) refuses it"
    )
    assert TOUCH in problems[0], problems
    with pytest.raises(
        CheckpointError, match="optimizer.pt: torch.load.weights_only=True. refuses it"
    ):
        load_checkpoint(path)
    with pytest.raises(
        CheckpointError,
        match=rf"weights_only allowlist \(UnpicklingError: global {re.escape(TOUCH)}",
    ):
        load_pickled_weights_only(path / "optimizer.pt", "cpu")
    assert not marker.exists()


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("cursor", 80, "cursor is 80 (int); it must be an object with int epoch and offset >= 0"),
        (
            "cursor",
            {"epoch": "0", "offset": 80},
            "cursor.epoch is '0' (str); it must be an int >= 0",
        ),
        ("cursor", {"epoch": 0, "offset": -8}, "cursor.offset is -8 (int); it must be an int >= 0"),
        ("cursor", {"epoch": 0}, "cursor.offset is None (NoneType); it must be an int >= 0"),
        ("step", "20", "step is '20' (str); it must be an int >= 0"),
        ("step", True, "step is True (bool); it must be an int >= 0"),
        ("step", 19, "step 19, manifest.json says 20"),
        ("scheduler", [20], "scheduler is [20] (list); it must be an object (its state_dict)"),
        ("grad_scaler", 1.0, "grad_scaler is 1.0 (float); it must be an object or null"),
        ("world_size", "2", "world_size is '2' (str); it must be an int >= 1 or null"),
        (
            "config",
            {"model": "gpt"},
            "config.model is 'gpt' (str); it must be an object (the model's settings)",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v else None,
)
def test_state_that_does_not_validate_is_damage_and_resume_falls_back(
    tmp_path, field, value, reason
):
    good, bad = save_run_state(tmp_path, 10), save_run_state(tmp_path, 20)
    state = json.loads((bad / "state.json").read_text())
    state[field] = value
    (bad / "state.json").write_text(json.dumps(state))
    reseal(bad)
    assert verify_checkpoint(bad) == [f"state.json: {reason}"]
    logs = []
    assert resolve_resume(tmp_path, "auto", log=logs.append) == good
    assert logs == [
        f"checkpoint step_00000020 is damaged (state.json: {reason}); falling back to step_00000010"
    ]
    ok, report = verify_report(bad)
    assert not ok and f"problem: state.json: {reason}" in report and "verdict: DAMAGED" in report


def test_state_of_a_run_to_continue_needs_step_and_cursor(tmp_path):
    bad = save_run_state(tmp_path, 20)
    state = json.loads((bad / "state.json").read_text())
    del state["cursor"]
    (bad / "state.json").write_text(json.dumps([state]))  # not even an object
    reseal(bad)
    [problem] = verify_checkpoint(bad)
    assert problem.startswith("state.json: holds [{'config'") and problem.endswith(
        "... (list), not a JSON object"
    )
    (bad / "state.json").write_text(json.dumps(state))
    reseal(bad)
    assert verify_checkpoint(bad) == [
        "state.json: has a scheduler but no 'cursor', which a resume continues from"
    ]
    # a merged (weights-only) checkpoint has no scheduler and no cursor: nothing to continue, nothing missing
    merged = save_checkpoint(
        tmp_path / "merged", 3, tensors(), None, None, {"step": 3, "merged_from": ["a", "b"]}
    )
    assert verify_checkpoint(merged) == []


# A pickle the weights-only loader refuses: a global outside its allowlist.
@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt", "grad_compression.pt"])
def test_pickle_refused_by_the_weights_only_loader_is_damage(tmp_path, name):
    marker = tmp_path / "pwned"
    good, bad = (save_run_state(tmp_path / "run", step, compression=True) for step in (10, 20))
    payload = {
        "optimizer.pt": {"state": {}, "param_groups": [], "hook": Evil(str(marker))},
        "rng.pt": [Evil(str(marker))],
        "grad_compression.pt": {**powersgd_state(2, 20), "hook": Evil(str(marker))},
    }[name]
    torch.save(payload, bad / name)
    reseal(bad)
    problems = verify_checkpoint(bad)
    assert problems == [
        f"{name}: torch.load(weights_only=True) refuses it (UnpicklingError: global "
        f"{TOUCH} is outside its allowlist)"
    ], problems
    logs = []
    assert resolve_resume(tmp_path / "run", "auto", log=logs.append) == good
    assert logs == [
        f"checkpoint step_00000020 is damaged ({problems[0]}); falling back to step_00000010"
    ]
    ok, report = verify_report(tmp_path / "run")
    assert not ok and f"step_00000020  DAMAGED: {problems[0]}" in report, report
    assert "--resume auto would take: step_00000010" in report
    with pytest.raises(CheckpointError, match=re.escape(problems[0])):  # named by path, no fallback
        resolve_resume(tmp_path / "run", str(bad))
    with pytest.raises(CheckpointError, match=re.escape(problems[0])):
        load_checkpoint(bad)
    assert not marker.exists()


def test_a_bare_pickle_of_a_payload_is_refused_without_running_it(tmp_path):
    # written by pickle.dump, not torch.save: neither the check nor the load unpickles it
    marker = tmp_path / "pwned"
    good, bad = (save_run_state(tmp_path / "run", step, compression=True) for step in (10, 20))
    (bad / "grad_compression.pt").write_bytes(pickle.dumps(Evil(str(marker)), protocol=2))
    reseal(bad)
    assert verify_checkpoint(bad) == [
        "grad_compression.pt: torch.load(weights_only=True) refuses it "
        "(RuntimeError: not in torch.save's zip format (a bare pickle, or damaged))"
    ]
    assert resolve_resume(tmp_path / "run", "auto", log=lambda _: None) == good
    file = bad / "grad_compression.pt"
    refused = (
        rf"^{re.escape(str(file))} holds objects outside torch's weights_only allowlist "
        rf"\(UnpicklingError: global {re.escape(TOUCH)} is outside"
    )
    with pytest.raises(CheckpointError, match=refused):
        load_pickled_weights_only(file, "cpu")
    file.write_bytes(b"")  # empty: torch.load's EOFError has no message
    ends = r"cannot be read by torch.load \(EOFError: the file ends early"
    with pytest.raises(CheckpointError, match=ends):
        load_pickled_weights_only(file, "cpu")
    assert not marker.exists()


def test_a_good_compression_state_verifies_and_loads_back(tmp_path):
    path = save_run_state(tmp_path, 20, compression=True)
    assert verify_checkpoint(path) == []
    loaded, want = load_checkpoint(path).compression, powersgd_state(2, 20)
    assert loaded.keys() == want.keys() and loaded["world_size"] == 2 and loaded["iter"] == 20
    assert torch.equal(loaded["q"]["weight"], want["q"]["weight"])
    assert all(torch.equal(loaded["errors"][1][k], v) for k, v in want["errors"][1].items())


def test_pickles_of_the_wrong_shape_are_damage(tmp_path):
    path = save_run_state(tmp_path, 20)
    # loads, but optimizer.load_state_dict needs state + param_groups
    torch.save([1, 2], path / "optimizer.pt")
    # 1 rank's state, state.json says 2 ranks
    torch.save([{"torch": torch.get_rng_state()}], path / "rng.pt")
    reseal(path)
    assert verify_checkpoint(path) == [
        "optimizer.pt: holds [1, 2] (list), not an optimizer state_dict (state, param_groups)",
        "rng.pt: holds 1 ranks' RNG states, state.json says world_size 2",
    ]
    # not torch.save's zip
    (path / "optimizer.pt").write_bytes(pickle.dumps({"state": {}, "param_groups": []}))
    reseal(path)
    assert verify_checkpoint(path)[0].startswith(
        "optimizer.pt: torch.load(weights_only=True) refuses it (RuntimeError"
    )


@pytest.mark.parametrize(
    "edit, reason",
    [
        (
            lambda c: [1, 2],
            "holds [1, 2] (list), not a gradient compression state (a dict with its kind)",
        ),
        (lambda c: {**c, "world_size": 0}, "world_size is 0 (int); it must be an int >= 1"),
        (lambda c: {**c, "iter": -1}, "iter is -1 (int); it must be an int >= 0"),
        (
            lambda c: {**c, "q": {"weight": [0.5]}},
            "q is {'weight': [0.5]} (dict); it must map parameter names to tensors",
        ),
        (
            lambda c: {**c, "errors": [{}]},  # one rank's: rank 1 would read errors[1]
            "errors is [{}] (list); it must be a list of 2 (its world_size) maps of parameter names to "
            "tensors, one per rank",
        ),
        (lambda c: powersgd_state(3, 20), "saved by 3 ranks, state.json says world_size 2"),
    ],
    ids=["not-a-dict", "world-size", "iter", "q", "errors", "ranks"],
)
def test_a_compression_state_a_resume_cannot_use_is_damage(tmp_path, edit, reason):
    # what lockstep.train.setup.load_compression_state reads: kind, world_size, iter, q, errors
    path = save_run_state(tmp_path, 20, compression=True)
    torch.save(edit(powersgd_state(2, 20)), path / "grad_compression.pt")
    reseal(path)
    assert verify_checkpoint(path) == [f"grad_compression.pt: {reason}"]


def test_quick_check_reads_sizes_not_contents(tmp_path):
    path = save_run_state(tmp_path, 20)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size: only a checksum sees it
    (path / "model.safetensors").write_bytes(bytes(data))
    assert quick_check(path) == [] and verify_checkpoint(path) == [
        "model.safetensors: checksum mismatch"
    ]
    truncate(path / "optimizer.pt", 10)
    assert quick_check(path) == [
        f"optimizer.pt: 10 bytes, manifest says "
        f"{json.loads((path / 'manifest.json').read_text())['files']['optimizer.pt']['bytes']}"
        " (truncated?)"
    ]
    assert quick_check(tmp_path / "nope") == [f"{tmp_path / 'nope'}: no such directory"]


def test_a_manifest_at_odds_with_its_dir(tmp_path):
    path = save(tmp_path, 5)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["step"] = 6  # copied into another run's step_00000005 by hand, say
    (path / "manifest.json").write_text(json.dumps(manifest))
    reseal(path)
    assert verify_checkpoint(path) == [
        "manifest.json: says step 6, directory is step_00000005",
        "state.json: step 5, manifest.json says 6",
    ]
    del manifest["files"]["model.safetensors"]  # still on disk, no longer listed
    manifest["step"] = 5
    (path / "manifest.json").write_text(json.dumps(manifest))
    reseal(path)
    assert (
        verify_checkpoint(path)
        == quick_check(path)
        == ["manifest.json: does not list model.safetensors"]
    )


def test_tensor_shapes_from_the_header_alone(tmp_path):
    path = save(tmp_path, 1)
    shapes = {"wte.weight": (16, 8), "ln.bias": (8,)}
    assert read_tensor_shapes(path) == read_tensor_shapes(path / "model.safetensors") == shapes
    (tmp_path / "other.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(
        CheckpointError,
        match=rf"cannot read the safetensors header of {tmp_path / 'other.safetensors'}",
    ):
        read_tensor_shapes(tmp_path / "other.safetensors")


def test_refusal_reason_is_one_line():
    assert (
        refusal_reason(
            pickle.UnpicklingError(
                "Weights only load failed. ... Unsupported global: GLOBAL "
                "os.system was not an allowed global by default."
            )
        )
        == "UnpicklingError: global os.system is outside its allowlist"
    )
    assert (
        refusal_reason(RuntimeError("\n  PytorchStreamReader failed  \nmore detail\n"))
        == "RuntimeError: PytorchStreamReader failed"
    )
    assert refusal_reason(EOFError()) == "EOFError: the file ends early (empty or truncated)"
    assert refusal_reason(RuntimeError("")) == "RuntimeError: (no message)"
    torch_says = (
        "Weights only load failed. In PyTorch 2.6, we changed ...\nPlease file an issue: "
        "WeightsUnpickler error: \n\nUnsupported operand 149\n\nCheck the documentation"
    )
    assert (
        refusal_reason(pickle.UnpicklingError(torch_says))
        == "UnpicklingError: Unsupported operand 149"
    )
    assert refusal_reason(ValueError("x" * 400)) == "ValueError: " + "x" * 300


def test_the_content_check_of_dcp_files_is_the_callers(tmp_path):
    from lockstep.checkpoint.sharded import save_sharded_checkpoint

    sharded = save_sharded_checkpoint(
        one_process(),
        tmp_path / "sharded",
        1,
        torch.nn.Linear(2, 2),
        None,
        None,
        {"step": 1},
        {},
        keep_last=1,
    )
    seen = []

    def dcp_check(path, listed):
        seen.append((path, sorted(listed)))
        return ["what the caller found"]

    assert checkpoint_problems(sharded) == []  # without one: the DCP files by size and sha256 only
    assert checkpoint_problems(sharded, dcp_check) == ["what the caller found"]
    assert seen == [(sharded, sorted(json.loads((sharded / "manifest.json").read_text())["files"]))]
    # no DCP files
    assert checkpoint_problems(save(tmp_path / "plain", 1), dcp_check) == [] and len(seen) == 1
