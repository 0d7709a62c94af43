import math

import pytest
import torch

from lockstep.config import ModelConfig
from lockstep.models.gpt import GPT, build_gpt


def tiny_cfg(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=256, hidden_size=32, attention_heads=2, layers=2, max_seq_length=16, dropout=0.0
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return build_gpt(tiny_cfg(**overrides))


def batch(
    B: int = 4, T: int = 16, vocab: int = 256, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (B, T + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def test_forward_shapes():
    model = tiny_model()
    idx, targets = batch(B=3, T=10)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 10, 256)
    assert loss.shape == () and loss.dtype == torch.float32
    logits, loss = model(idx)
    assert loss is None


def test_causal():
    model = tiny_model().eval()
    idx, _ = batch(B=2, T=16)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_head_tied_to_token_embedding():
    model = tiny_model()
    assert model.head.weight is model.tok_emb.weight
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    # Tied tensor counted once: V*C appears a single time in the total.
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert model.num_params(non_embedding=False) == total


def test_num_params_by_hand():
    cfg = tiny_cfg()
    model = build_gpt(cfg)
    V, C, L, S = cfg.vocab_size, cfg.hidden_size, cfg.layers, cfg.max_seq_length
    per_block = (
        2 * 2 * C  # two LayerNorms, weight + bias
        + (C * 3 * C + 3 * C)  # qkv
        + (C * C + C)  # attention projection
        + (C * 4 * C + 4 * C)  # mlp fc
        + (4 * C * C + C)  # mlp projection
    )
    expected = V * C + L * per_block + 2 * C  # token emb (= head), blocks, final LayerNorm
    assert model.num_params(non_embedding=True) == expected
    assert model.num_params(non_embedding=False) == expected + S * C


def test_init_loss_near_ln_vocab():
    model = tiny_model()
    idx, targets = batch(B=8, T=16)
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_residual_projections_scaled_init():
    torch.manual_seed(0)
    model = build_gpt(tiny_cfg(hidden_size=256, attention_heads=4, layers=8))
    want = 0.02 / math.sqrt(2 * 8)
    for block in model.blocks:
        assert abs(block.attn.proj.weight.std().item() - want) < 0.1 * want
        assert abs(block.mlp.proj.weight.std().item() - want) < 0.1 * want
    assert abs(block.mlp.fc.weight.std().item() - 0.02) < 0.002


def test_gradient_checkpointing_matches():
    idx, targets = batch()
    plain = tiny_model(seed=3)
    ckpt = tiny_model(seed=3, gradient_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    _, loss_a = plain(idx, targets)
    _, loss_b = ckpt(idx, targets)
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b)
    for (name, pa), (_, pb) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_flops_per_token_formula():
    cfg = tiny_cfg()
    model = build_gpt(cfg)
    n = model.num_params(non_embedding=True)
    assert model.flops_per_token() == 6 * n + 12 * 2 * 32 * 16


def test_too_long_sequence_raises():
    model = tiny_model()
    idx = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(ValueError, match=r"17.*16"):
        model(idx)


def test_generate_shape_prompt_and_greedy_determinism():
    model = tiny_model().eval()
    prompt, _ = batch(B=2, T=5)
    # runs past max_seq_length: crops
    out = model.generate(prompt, max_new_tokens=20, temperature=0.0)
    assert out.shape == (2, 25)
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=20, temperature=0.0))
    assert out.min() >= 0 and out.max() < 256


def test_generate_sampling_seeded():
    model = tiny_model().eval()
    prompt, _ = batch(B=2, T=5)
    a = model.generate(
        prompt, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7)
    )
    b = model.generate(
        prompt, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7)
    )
    assert a.shape == (2, 13)
    assert torch.equal(a, b)
    assert torch.equal(a[:, :5], prompt)


def test_generate_top_k_1_is_greedy():
    model = tiny_model().eval()
    prompt, _ = batch(B=2, T=5)
    sampled = model.generate(
        prompt, 6, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(sampled, model.generate(prompt, 6, temperature=0.0))


def test_bf16_autocast_loss_close_to_fp32():
    model = tiny_model()
    idx, targets = batch()
    _, loss32 = model(idx, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss16 = model(idx, targets)
    assert logits.dtype == torch.bfloat16
    assert loss16.dtype == torch.float32
    assert abs(loss16.item() - loss32.item()) < 0.05


def test_model_does_not_import_torch_distributed():
    import ast

    import lockstep.models.gpt as gpt

    tree = ast.parse(open(gpt.__file__).read())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("torch.distributed")]
