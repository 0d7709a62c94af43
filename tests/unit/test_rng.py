"""A process's random number generators captured and restored (lockstep/rng.py): the same streams afterwards,
through a torch.load(weights_only=True) round trip, and seed_everything seeding all three."""

from __future__ import annotations

import random

import numpy as np
import torch

from lockstep.rng import capture_rng_state, restore_rng_state, seed_everything


def draws() -> tuple:
    """The next values of each generator lockstep restores: torch, python, numpy (incl. numpy's cached gaussian)."""
    return (
        torch.rand(4).tolist(),
        torch.randint(0, 1000, (3,)).tolist(),
        random.random(),
        random.getrandbits(64),
        np.random.rand(3).tolist(),
        float(np.random.standard_normal()),
    )


def test_restore_replays_the_same_streams(tmp_path):
    seed_everything(123)
    draws()  # advance each generator past its seeded start
    np.random.standard_normal(3)  # an odd count of gaussians: numpy caches the second of a pair
    state = capture_rng_state()
    expected = draws()
    assert draws() != expected  # the streams moved on
    torch.save(state, tmp_path / "rng.pt")  # as a checkpoint stores it
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == expected


def test_seed_everything_seeds_every_generator():
    seed_everything(7)
    first = draws()
    seed_everything(7)
    assert draws() == first
    seed_everything(8)
    assert draws() != first
    seed_everything(2**40 + 7)  # numpy takes 32-bit seeds: larger ones are reduced, not refused
    assert np.random.get_state()[1][0] == np.random.RandomState(7).get_state()[1][0]


def test_state_holds_only_what_weights_only_loading_accepts():
    state = capture_rng_state()
    assert set(state) >= {"torch", "python", "numpy"}
    assert (
        isinstance(state["numpy"]["keys"], torch.Tensor)
        and state["numpy"]["keys"].dtype == torch.int64
    )
    assert state["numpy"]["keys"].shape == (624,) and state["numpy"]["name"] == "MT19937"
