"""A rank's memory by formula, for a model whose step cannot run on fake tensors (a data-dependent
shape in its forward, or a batch a plan cannot know): the plan says it is an estimate.

What is exact: parameters, gradients and AdamW's two moments, from the rank's real shards (the model
is built and sharded as `train` shards it, only its step is not run). What is a rule of thumb:

- activations of a transformer block, per token it reads: the tensors its backward needs, ~10 x
  hidden (the norms' inputs and outputs, q, k, v, attention's output, the residuals) and 4 x the
  MLP's width (gate, up, their activation and product), in the compute dtype. Korthikanti et al.
  2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1) count 34 x
  hidden bytes at 16 bits for GPT-3's blocks, attention scores aside, which flash attention does not
  keep; ours is 10 x 2 + 4 x 2 x (8/3): 41 for a Llama block. Simulated Llama blocks in float32
  (58M, bench/bench_plan_hf.py) keep 10.5 x hidden + 4 x the MLP's width a token.
- a LoRA adapter (counted from the model's own adapters, exact): its input after its dropout and
  the dropout's mask (one byte an element; none when lora_dropout is 0), and its rank-wide middle,
  for the tokens its module reads (ModelShape.token_shares: Higgs Audio v2's text and audio MLPs
  each read a part).
- activation checkpointing keeps each block's input; its peak is the larger of one block's tensors
  during its recompute and the logits' moment below.
- the logits, float32, for every target of a micro-batch, three at once at the loss's backward:
  the log-probabilities saved for it, their gradient and the logits' (the simulated Llama's and
  the tracked real Higgs Audio v2's peak).
- FSDP: two blocks' parameters gathered at once in the compute dtype (the one in use, the next one
  prefetched); while the step accumulates, each micro-batch's gradients whole, unsharded (no
  reduce-scatter before the last, lockstep.parallel.fsdp).
"""

from __future__ import annotations

from torch import nn

from lockstep.plan.models import ModelShape

PER_HIDDEN, PER_INTERMEDIATE = 10, 4  # activation elements per token of a block, by width
LOGIT_COPIES = 3  # float32 logits alive at once at the loss's backward


def formula_memory(
    model: nn.Module,
    shape: ModelShape,
    micro: int,
    *,
    act_bytes: int,
    checkpointing: bool,
    data_parallel: str,
    dp: int,
    accumulating: bool = False,
) -> dict[str, int]:
    """Bytes per part (lockstep.plan.fake_step.ORDER's names) at one step's peak."""
    parts: dict[str, int] = {}
    params = grads = full = whole_grads = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        size = local.numel() * local.element_size()
        params += size
        full += p.numel()
        if p.requires_grad:
            grads += size
            whole_grads += p.numel() * local.element_size()
    sharded = data_parallel == "fsdp" and dp > 1
    parts["parameters"] = params
    parts["ddp buckets" if data_parallel == "ddp" and dp > 1 else "gradients"] = (
        whole_grads if sharded and accumulating else grads
    )
    parts["optimizer"] = 2 * grads  # AdamW's exp_avg and exp_avg_sq, as its parameters
    if sharded:
        parts["gathered parameters"] = 2 * full // max(shape.layers, 1) * act_bytes
    tokens = micro * shape.tokens_per_sample
    layer_tokens = micro * (shape.layer_tokens or shape.layers * shape.tokens_per_sample)
    per_token = (PER_HIDDEN * shape.hidden + PER_INTERMEDIATE * shape.intermediate) * act_bytes
    adapters = int(tokens * _adapter_bytes_per_token(model, act_bytes, dict(shape.token_shares)))
    logits = LOGIT_COPIES * micro * (shape.targets_per_sample or shape.tokens_per_sample)
    parts["temporary"] = logits * shape.logits * 4
    if checkpointing:
        block = tokens * per_token + adapters // max(shape.layers, 1)
        recompute = max(0, block - parts["temporary"])  # the larger of the two moments
        parts["activations"] = layer_tokens * shape.hidden * act_bytes + recompute
    else:
        parts["activations"] = layer_tokens * per_token + adapters
    return parts


def _adapter_bytes_per_token(model: nn.Module, act_bytes: int, shares: dict[str, float]) -> float:
    """What the LoRA adapters of `model` keep for their backward, per token of a sample (peft's
    LoraLayer: lora_A, lora_dropout and r, by adapter name), each adapter at the share of the
    tokens its module reads (`shares`, by a name in its path; all of them elsewhere)."""
    kept = 0.0
    for path, module in model.named_modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "lora_dropout"):
            continue
        share = next((shares[part] for part in path.split(".") if part in shares), 1.0)
        for name, down in module.lora_A.items():
            dropped = getattr(module.lora_dropout[name], "p", 0.0) > 0
            per_token = module.r[name] * act_bytes
            per_token += down.in_features * (act_bytes + 1) if dropped else 0
            kept += share * per_token
    return kept
