"""The sbatch script's fixed texts (lockstep/launch/slurm_text.py): the requeue trap is bash that defines
and sets its handler, and the elastic note, for either store, is comment lines only, so that no wording
of it can run as a command. In a rendered script: tests/unit/launch/test_slurm.py."""

from __future__ import annotations

import subprocess

import pytest

from lockstep.launch.slurm_text import ELASTIC_NOTE, REQUEUE_TRAP, STORE_NOTE


def test_the_requeue_trap_is_bash_that_sets_its_handler():
    trap = REQUEUE_TRAP.format(lead=120)
    assert "USR1 arrives 120 s ahead" in trap and trap.endswith("trap lockstep_requeue USR1")
    checked = subprocess.run(["bash", "-n"], input=trap, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    shown = subprocess.run(
        ["bash", "-c", trap + "\ntrap -p USR1"], capture_output=True, text=True, timeout=30
    )
    assert shown.stdout.strip() == "trap -- 'lockstep_requeue' SIGUSR1"


@pytest.mark.parametrize("store", sorted(STORE_NOTE))
def test_the_elastic_note_is_comments_only(store):
    note = ELASTIC_NOTE.format(low=1, high=2, restarts=3, store=STORE_NOTE[store])
    lines = note.splitlines()
    assert all(line.startswith("# ") for line in lines), lines
    assert STORE_NOTE[store].split("\n")[0] in note and "--max-restarts 3" in note
