"""A rank's memory by formula, for a model whose step cannot run on fake tensors (a data-dependent
shape in its forward, or a batch a plan cannot know): the plan says it is an estimate.

What is exact: parameters, gradients and AdamW's two moments, from the rank's real shards (the model
is built and sharded as `train` shards it, only its step is not run). What is a rule of thumb:

- activations of a transformer block, per token: the tensors its backward needs, ~10 x hidden (the
  norms' inputs and outputs, q, k, v, attention's output, the residuals, a LoRA adapter's input) and
  4 x the MLP's width (gate, up, their activation and product), in the compute dtype. Korthikanti et
  al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1) count
  34 x hidden bytes at 16 bits for GPT-3's blocks, attention scores aside, which flash attention
  does not keep; ours is 10 x 2 + 4 x 2 x (8/3): 41 for a Llama block.
- activation checkpointing keeps each block's input and one block's tensors during its recompute.
- temporaries: the logits and their gradient in float32, for every target of a micro-batch.
- FSDP: two blocks' parameters gathered at once in the compute dtype (the one in use, the next one
  prefetched).
"""

from __future__ import annotations

from torch import nn

from lockstep.plan.models import ModelShape

PER_HIDDEN, PER_INTERMEDIATE = 10, 4  # activation elements per token of a block, by width


def formula_memory(
    model: nn.Module,
    shape: ModelShape,
    micro: int,
    *,
    act_bytes: int,
    checkpointing: bool,
    data_parallel: str,
    dp: int,
) -> dict[str, int]:
    """Bytes per part (lockstep.plan.fake_step.ORDER's names) at one step's peak."""
    parts: dict[str, int] = {}
    params = grads = full = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        size = local.numel() * local.element_size()
        params += size
        full += p.numel()
        if p.requires_grad:
            grads += size
    parts["parameters"] = params
    parts["ddp buckets" if data_parallel == "ddp" and dp > 1 else "gradients"] = grads
    parts["optimizer"] = 2 * grads  # AdamW's exp_avg and exp_avg_sq, as its parameters
    if data_parallel == "fsdp" and dp > 1:
        parts["gathered parameters"] = 2 * full // max(shape.layers, 1) * act_bytes
    tokens = micro * shape.tokens_per_sample
    block = tokens * (PER_HIDDEN * shape.hidden + PER_INTERMEDIATE * shape.intermediate) * act_bytes
    if checkpointing:
        parts["activations"] = shape.layers * tokens * shape.hidden * act_bytes + block
    else:
        parts["activations"] = shape.layers * block
    parts["temporary"] = 2 * tokens * shape.logits * 4
    return parts
