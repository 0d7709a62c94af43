"""A GPT-2 style decoder-only transformer, nanoGPT-like.

Pre-norm blocks (LayerNorm -> causal attention -> residual; LayerNorm -> 4x GELU MLP -> residual),
learned position embeddings, and an output head tied to the token embedding. Linear layers and
LayerNorms carry biases, as in GPT-2.

Shape letters: B batch, T sequence length, C hidden size, nh heads, hs head size (C // nh), V vocab.
This module never imports `torch.distributed`: parallelism is applied from outside by `apply_*`.
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
        self.n_head = cfg.attention_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # q, k, v for all heads in one matmul
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)  # residual output projection
        self.proj.is_residual_proj = True  # GPT-2 init scales this by 1/sqrt(2 * layers)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        # SDPA picks a flash / memory-efficient kernel where one exists; is_causal masks the future.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.resid_dropout(self.proj(y))


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
        """Logits (B, T, V) for token ids idx (B, T); with targets (B, T), also the mean cross-entropy."""
        B, T = idx.shape
        if T > self.cfg.max_seq_length:
            raise ValueError(
                f"sequence length {T} exceeds model.max_seq_length ({self.cfg.max_seq_length}); "
                f"crop the input to at most {self.cfg.max_seq_length} tokens or build the model "
                f"with model.max_seq_length >= {T}"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C) + (T, C) broadcast
        for block in self.blocks:
            if self.cfg.gradient_checkpointing and self.training:
                # Keep only the block's input; recompute its activations in backward. Non-reentrant
                # checkpointing works with autocast, kwargs and inputs that need no grad.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        logits = self.head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            # float32 so log-softmax over V is accurate when autocast made the logits bf16.
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. Tied weights count once; non_embedding drops the position embeddings
        (the token embedding is also the output head, so it stays)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if non_embedding:
            n -= self.pos_emb.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward + backward (PaLM, Chowdhery et al. 2022, appendix B):

            6 * N + 12 * layers * hidden * seq_len

        N = num_params(non_embedding=True). 6N: each weight does a multiply-add (2 FLOPs) per token
        forward and twice that backward. The second term is attention's QK^T and AV products, which
        have no weights: 2 matmuls x 2 FLOPs x hidden x seq_len per layer forward, times 3 for backward.
        """
        c = self.cfg
        return 6 * self.num_params(non_embedding=True) + 12 * c.layers * c.hidden_size * c.max_seq_length

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
            logits = logits[:, -1, :].float()  # (B, V): only the last position predicts the next token
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


def build_gpt(cfg: ModelConfig) -> GPT:
    """A freshly initialized GPT. Seed torch's RNG before calling for a reproducible init."""
    return GPT(cfg)
