"""A Higgs model whose next audio code is known: an output bias on its audio head (a helper, no tests)."""

from __future__ import annotations


def set_output_bias(model, codebooks, code: int) -> None:
    """Give `model`'s audio head an output bias that makes `code` certain in each of `codebooks`
    (where the delay pattern lets that codebook speak): a model whose next code is known, the rest
    of it untouched."""
    import torch

    c, head = model.config, model.audio_lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        for k in codebooks:
            biased.bias[k * c.codebook_size + code] = 1e4
    model.audio_lm_head = biased
