"""A GPT-2 style decoder-only transformer, nanoGPT-like.

Pre-norm blocks (LayerNorm -> causal attention -> residual; LayerNorm -> 4x GELU MLP -> residual),
learned position embeddings, and an output head tied to the token embedding. Linear layers and
LayerNorms carry biases, as in GPT-2.

Shape letters: B batch, T sequence length, C hidden size, nh heads, hs head size (C // nh), V vocab.
This module never imports `torch.distributed`: parallelism is applied from outside by `apply_*`.
Two things here exist for it:

- attn.qkv packs its output rows head-major, [q_h0 k_h0 v_h0 | q_h1 k_h1 v_h1 | ...], so a tensor-parallel
  column split (lockstep.parallel.tp) gives each rank whole heads; attention reads its head count from
  the width it receives.
- a pipeline stage (lockstep.parallel.pp) is this model with parts set to None: no tok_emb (the input is
  hidden states), no ln_f/head (the output is hidden states), None in place of other stages' blocks, so
  every parameter keeps its full-model name (blocks.3.attn.qkv.weight on whichever stage runs block 3).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lockstep.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.hidden_size % cfg.attention_heads == 0, "validate_config checks this"
        self.head_size = cfg.hidden_size // cfg.attention_heads
        self.dropout = cfg.dropout
        # q, k, v for all heads in one matmul; output rows head-major (see the module docstring)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)  # residual output projection
        self.proj.is_residual_proj = True  # GPT-2 init scales this by 1/sqrt(2 * layers)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # nh here is the heads this process holds: all of them, or nh / tp under tensor parallelism
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_size)  # (B, T, nh, 3, hs)
        q, k, v = qkv.transpose(1, 2).unbind(dim=3)  # 3 x (B, nh, T, hs)
        # SDPA picks a flash / memory-efficient kernel where one exists; is_causal masks the future.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs): heads side by side again
        return self.resid_dropout(self.proj(y))


def qkv_head_major(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """attn.qkv weight (3C, C) or bias (3C,) from the [q | k | v] row order to head-major
    [q_h0 k_h0 v_h0 | q_h1 ...]; converts GPT checkpoints written before the layout changed."""
    return t.reshape(3, n_head, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def upgrade_format_1(tensors: dict[str, torch.Tensor], state: dict) -> dict[str, torch.Tensor]:
    """The tensors of a format-1 checkpoint as this GPT reads them; the loaders of lockstep.checkpoint take it
    as `upgrade`. Format-1 GPT checkpoints packed attn.qkv as [q | k | v]; same names and shapes, so without
    this they would load silently wrong. Checkpoints of other model kinds (state.json's config) pass unchanged."""
    model = (state.get("config") or {}).get("model") or {}
    if model.get("kind", "gpt") != "gpt":
        return tensors
    # ModelConfig's default, for configs that left it out
    heads = int(model.get("attention_heads", 4))
    return {
        k: qkv_head_major(v, heads) if k.endswith(("attn.qkv.weight", "attn.qkv.bias")) else v
        for k, v in tensors.items()
    }


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.proj = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)  # residual output projection
        self.proj.is_residual_proj = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))  # (B, T, 4C) inside, (B, T, C) out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-norm: the residual stream itself is never normalized, which keeps deep stacks trainable.
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_emb = nn.Embedding(cfg.max_seq_length, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)
        # None: run by another pipeline stage
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Weight tying: one (V, C) matrix both embeds tokens and scores them. Saves V*C parameters
        # and works as well or better at this scale (Press & Wolf 2017).
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: each block adds two projections into the residual stream, so their variance
        # grows with depth; scaling their init by 1/sqrt(2 * layers) keeps the stream's scale steady.
        for module in self.modules():
            if getattr(module, "is_residual_proj", False):
                nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.layers))
        # The draw above filled qkv in the old [q | k | v] order; reordering it keeps a seed's network
        # exactly what it was before the head-major layout (the distribution is the same either way).
        with torch.no_grad():
            for block in self.blocks:
                block.attn.qkv.weight.copy_(
                    qkv_head_major(block.attn.qkv.weight, cfg.attention_heads)
                )

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # LayerNorm keeps its default weight 1, bias 0.

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) for token ids idx (B, T); with targets (B, T), also the mean cross-entropy.

        A pipeline stage without tok_emb takes hidden states (B, T, C) as idx; one without head
        returns hidden states (B, T, C) in place of the logits, and no loss.
        """
        if self.tok_emb is not None:
            T = idx.size(1)
            if T > self.cfg.max_seq_length:
                raise ValueError(
                    f"sequence length {T} exceeds model.max_seq_length ({self.cfg.max_seq_length}); "
                    f"crop the input to at most {self.cfg.max_seq_length} tokens or build the model "
                    f"with model.max_seq_length >= {T}"
                )
            pos = torch.arange(T, device=idx.device)  # (T,)
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C) + (T, C) broadcast
        else:
            x = idx  # (B, T, C) from the previous pipeline stage
        for block in self.blocks:
            if block is None:
                continue
            if self.cfg.gradient_checkpointing and self.training:
                # Keep only the block's input; recompute its activations in backward. Non-reentrant
                # checkpointing works with autocast, kwargs and inputs that need no grad.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.head is None:
            return x, None
        x = self.ln_f(x)
        logits = self.head(x)  # (B, T, V)
        return logits, None if targets is None else lm_loss(logits, targets)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. Tied weights count once; non_embedding drops the position embeddings
        (the token embedding is also the output head, so it stays)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if non_embedding and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward + backward (PaLM, Chowdhery et al. 2022, appendix B):

            6 * N + 12 * layers * hidden * seq_len

        N = num_params(non_embedding=True). 6N: each weight does a multiply-add (2 FLOPs) per token
        forward and twice that backward. The second term is attention's QK^T and AV products, which
        have no weights: 2 matmuls x 2 FLOPs x hidden x seq_len per layer forward, times 3 for backward.
        Call it on the full model, not on a pipeline stage.
        """
        c = self.cfg
        return (
            6 * self.num_params(non_embedding=True)
            + 12 * c.layers * c.hidden_size * c.max_seq_length
        )

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend idx (B, T0) by max_new_tokens sampled tokens -> (B, T0 + max_new_tokens).

        temperature 0 picks the argmax (greedy); top_k keeps only the k likeliest tokens.
        Call model.eval() first if the model has dropout.
        """
        if temperature < 0:
            raise ValueError(f"temperature = {temperature} must be >= 0 (0 = greedy)")
        for _ in range(max_new_tokens):
            # The model only knows max_seq_length positions: condition on the most recent ones.
            context = idx[:, -self.cfg.max_seq_length :]  # (B, <= max_seq_length)
            logits, _ = self(context)
            logits = logits[
                :, -1, :
            ].float()  # (B, V): only the last position predicts the next token
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)  # (B, V)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, next_id), dim=1)  # (B, T + 1)
        return idx


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T)."""
    # float32 so log-softmax over V is accurate when autocast made the logits bf16.
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def batch_loss(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss of a batch of (token ids, next-token targets), each (B, T): what a step minimizes."""
    x, y = batch
    return model(x, y)[1]


def build_gpt(cfg: ModelConfig) -> GPT:
    """A freshly initialized GPT. Seed torch's RNG before calling for a reproducible init."""
    return GPT(cfg)
