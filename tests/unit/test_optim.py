import pytest
import torch

from lockstep.config import ModelConfig, OptimConfig
from lockstep.models.gpt import build_gpt
from lockstep.optim import build_optimizer, build_scheduler, lr_at, scaled_learning_rate


def tiny_model():
    torch.manual_seed(0)
    return build_gpt(ModelConfig(vocab_size=256, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16))


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


def test_scaled_learning_rate_modes():
    base = dict(learning_rate=1e-3, reference_batch_size=32)
    assert scaled_learning_rate(OptimConfig(lr_scaling="none", **base), 128) == pytest.approx(1e-3)
    assert scaled_learning_rate(OptimConfig(lr_scaling="linear", **base), 128) == pytest.approx(4e-3)
    assert scaled_learning_rate(OptimConfig(lr_scaling="sqrt", **base), 128) == pytest.approx(2e-3)
    assert scaled_learning_rate(OptimConfig(lr_scaling="linear", **base), 8) == pytest.approx(2.5e-4)
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


@pytest.mark.parametrize("optimizer_first", [True, False], ids=["load-optimizer-first", "load-scheduler-first"])
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
