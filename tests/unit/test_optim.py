import pytest
import torch
from transformers import TrainingArguments, get_scheduler

from lockstep.config import ModelConfig, OptimConfig
from lockstep.models.gpt import build_gpt
from lockstep.optim import (
    build_optimizer,
    build_scheduler,
    lr_at,
    scaled_learning_rate,
    warmup_steps_for,
)


def tiny_model():
    torch.manual_seed(0)
    return build_gpt(
        ModelConfig(vocab_size=256, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16)
    )


def test_decay_groups_hold_exactly_the_matrices():
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), lr=1e-3, device_type="cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    want_decay = {id(p) for p in model.parameters() if p.dim() >= 2}
    want_none = {id(p) for p in model.parameters() if p.dim() < 2}
    assert {id(p) for p in decay["params"]} == want_decay
    assert {id(p) for p in no_decay["params"]} == want_none
    # The tied embedding/head appears exactly once.
    all_ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(all_ids) == len(set(all_ids))
    assert all_ids.count(id(model.tok_emb.weight)) == 1


def test_optimizer_settings_and_frozen_params_skipped():
    model = tiny_model()
    model.pos_emb.weight.requires_grad_(False)
    cfg = OptimConfig(beta1=0.8, beta2=0.99, eps=1e-6)
    opt = build_optimizer(model, cfg, lr=3e-4, device_type="cpu")
    for g in opt.param_groups:
        assert g["lr"] == 3e-4 and g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6
    assert all(p is not model.pos_emb.weight for g in opt.param_groups for p in g["params"])


def test_optimizer_steps_reduce_loss():
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig(), lr=3e-3, device_type="cpu")
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4, 17), generator=g)
    idx, targets = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(10):
        _, loss = model(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("device_type", ["cpu", "meta"])
def test_fused_only_where_supported(device_type):
    opt = build_optimizer(tiny_model(), OptimConfig(), lr=1e-3, device_type=device_type)
    assert bool(opt.defaults.get("fused")) == (device_type == "cpu")


def test_lr_at_warmup_and_cosine():
    cfg = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    total = 110
    assert lr_at(0, cfg, total) == pytest.approx(0.1)  # (0 + 1) / 10
    assert lr_at(4, cfg, total) == pytest.approx(0.5)
    assert lr_at(9, cfg, total) == pytest.approx(1.0)  # last warmup step
    assert lr_at(10, cfg, total) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(60, cfg, total) == pytest.approx(0.55)  # midpoint: (1 + 0.1) / 2
    assert lr_at(110, cfg, total) == pytest.approx(0.1)
    assert lr_at(500, cfg, total) == pytest.approx(0.1)
    values = [lr_at(s, cfg, total) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_lr_at_no_warmup():
    cfg = OptimConfig(warmup_steps=0, min_lr_ratio=0.0)
    assert lr_at(0, cfg, 100) == pytest.approx(1.0)
    assert lr_at(50, cfg, 100) == pytest.approx(0.5)
    assert lr_at(100, cfg, 100) == pytest.approx(0.0)


def test_lr_at_linear_decay():
    cfg = OptimConfig(warmup_steps=10, min_lr_ratio=0.0, schedule="linear")
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)  # warmup ends at the peak
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)  # decay starts at the peak
    assert lr_at(60, cfg, 110) == pytest.approx(0.5)  # middle of the decay
    assert lr_at(109, cfg, 110) == pytest.approx(0.01)  # last step: 1 / 100
    assert lr_at(110, cfg, 110) == 0.0 and lr_at(500, cfg, 110) == 0.0
    floor = OptimConfig(warmup_steps=10, min_lr_ratio=0.2, schedule="linear")
    assert lr_at(60, floor, 110) == pytest.approx(0.6)  # 0.2 + 0.8 x 0.5
    assert lr_at(110, floor, 110) == pytest.approx(0.2)
    assert lr_at(300, floor, 110) == pytest.approx(0.2)


def test_lr_at_constant_after_warmup():
    cfg = OptimConfig(warmup_steps=4, min_lr_ratio=0.1, schedule="constant")
    assert [lr_at(s, cfg, 20) for s in (0, 1, 3)] == pytest.approx([0.25, 0.5, 1.0])
    assert [lr_at(s, cfg, 20) for s in (4, 12, 19, 20, 99)] == [1.0] * 5  # no floor, no decay


@pytest.mark.parametrize(
    "ratio, total, steps", [(0.1, 25, 3), (0.1, 100, 10), (0.0, 50, 0), (0.03, 1000, 30)]
)
def test_warmup_ratio_rounds_up_as_transformers(ratio, total, steps):
    cfg = OptimConfig(warmup_ratio=ratio)  # warmup_steps keeps its default 50: the ratio wins
    assert warmup_steps_for(cfg, total) == steps
    assert TrainingArguments("out", warmup_steps=ratio).get_warmup_steps(total) == steps
    if steps:
        assert lr_at(steps - 1, cfg, total) == 1.0 and lr_at(steps - 2, cfg, total) < 1.0


def test_warmup_ratio_drives_lr_at():
    cfg = OptimConfig(warmup_ratio=0.25, schedule="linear", min_lr_ratio=0.0)
    got = [lr_at(s, cfg, 40) for s in (0, 9, 10, 25, 40)]
    assert got == pytest.approx([0.1, 1.0, 1.0, 0.5, 0.0])


def _hf_and_lockstep_lrs(hf_name: str, cfg: OptimConfig, total: int, **kwargs) -> tuple[list, list]:
    """Each optimizer step's lr from transformers' get_scheduler and from build_scheduler, both over
    a real AdamW stepping a real model."""
    runs = []
    for build in ("hf", "lockstep"):
        opt = build_optimizer(tiny_model(), cfg, lr=1e-3, device_type="cpu")
        if build == "hf":
            warmup = warmup_steps_for(cfg, total)
            sched = get_scheduler(
                hf_name,
                opt,
                num_warmup_steps=warmup,
                num_training_steps=total,
                scheduler_specific_kwargs=kwargs,
            )
        else:
            sched = build_scheduler(opt, cfg, total)
        lrs = []
        for _ in range(total):
            lrs.append(opt.param_groups[0]["lr"])  # the lr this step trains with
            opt.step()
            sched.step()
        runs.append(lrs)
    return runs[0], runs[1]


@pytest.mark.parametrize(
    "hf_name, cfg, kwargs",
    [
        ("linear", OptimConfig(schedule="linear", warmup_steps=5, min_lr_ratio=0.0), {}),
        ("cosine", OptimConfig(schedule="cosine", warmup_ratio=0.1, min_lr_ratio=0.0), {}),
        (
            "cosine_with_min_lr",
            OptimConfig(schedule="cosine", warmup_steps=5, min_lr_ratio=0.1),
            {"min_lr_rate": 0.1},
        ),
        ("constant_with_warmup", OptimConfig(schedule="constant", warmup_steps=5), {}),
        ("linear", OptimConfig(schedule="linear", warmup_steps=0, min_lr_ratio=0.0), {}),
    ],
)
def test_schedules_match_transformers_but_for_warmup_one_step_ahead(hf_name, cfg, kwargs):
    total = 40
    hf, ours = _hf_and_lockstep_lrs(hf_name, cfg, total, **kwargs)
    warmup = warmup_steps_for(cfg, total)
    # after warmup: the same lr at every step
    assert ours[warmup:] == pytest.approx(hf[warmup:], rel=1e-6, abs=1e-12)
    # during warmup, off by one on purpose: lockstep's step s trains at HF's step s + 1 (HF's
    # step 0 trains at lr 0); lockstep's last warmup step and HF's first after it: both the peak
    assert ours[:warmup] == pytest.approx(hf[1 : warmup + 1], rel=1e-6)
    if warmup:
        assert hf[0] == 0.0 and ours[0] == pytest.approx(1e-3 / warmup)


def test_scaled_learning_rate_modes():
    base = dict(learning_rate=1e-3, reference_batch_size=32)
    assert scaled_learning_rate(OptimConfig(lr_scaling="none", **base), 128) == pytest.approx(1e-3)
    assert scaled_learning_rate(OptimConfig(lr_scaling="linear", **base), 128) == pytest.approx(
        4e-3
    )
    assert scaled_learning_rate(OptimConfig(lr_scaling="sqrt", **base), 128) == pytest.approx(2e-3)
    assert scaled_learning_rate(OptimConfig(lr_scaling="linear", **base), 8) == pytest.approx(
        2.5e-4
    )
    with pytest.raises(ValueError, match="'none', 'linear', 'sqrt'"):
        scaled_learning_rate(OptimConfig(lr_scaling="cubic", **base), 32)


def test_scheduler_follows_lr_at():
    cfg = OptimConfig(warmup_steps=4, min_lr_ratio=0.1)
    model = tiny_model()
    opt = build_optimizer(model, cfg, lr=2e-3, device_type="cpu")
    sched = build_scheduler(opt, cfg, total_steps=20)
    for step in range(25):
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(2e-3 * lr_at(step, cfg, 20))
        opt.step()
        sched.step()


@pytest.mark.parametrize(
    "optimizer_first", [True, False], ids=["load-optimizer-first", "load-scheduler-first"]
)
def test_scheduler_state_round_trip(tmp_path, optimizer_first):
    cfg = OptimConfig(warmup_steps=4, min_lr_ratio=0.1)
    opt = build_optimizer(tiny_model(), cfg, lr=2e-3, device_type="cpu")
    sched = build_scheduler(opt, cfg, total_steps=20)
    for _ in range(7):
        opt.step()
        sched.step()
    torch.save({"scheduler": sched.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert all(fn is None for fn in state["scheduler"]["lr_lambdas"])  # the closure is not saved

    # Either order of loading must leave the optimizer at step 7's lr.
    opt2 = build_optimizer(tiny_model(), cfg, lr=2e-3, device_type="cpu")
    if optimizer_first:
        opt2.load_state_dict(state["optimizer"])
    sched2 = build_scheduler(opt2, cfg, total_steps=20)
    if not optimizer_first:
        opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])
    assert sched2.last_epoch == 7
    assert sched2.base_lrs == pytest.approx([2e-3, 2e-3])
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr())
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([2e-3 * lr_at(7, cfg, 20)] * 2)
    for _ in range(3):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr())
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([2e-3 * lr_at(10, cfg, 20)] * 2)
