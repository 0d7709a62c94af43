"""lockstep.models.lora on the tiny Llama: the target list parsed, the wrapper peft builds (task
type, frozen base, trainable adapters), and a target list that matches nothing named with the layers
that exist."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from lockstep.config import ModelConfig  # noqa: E402
from lockstep.errors import ConfigError  # noqa: E402
from lockstep.models.lora import apply_lora, linear_names, lora_targets  # noqa: E402

LLAMA_LINEARS = [
    "down_proj",
    "gate_proj",
    "k_proj",
    "lm_head",
    "o_proj",
    "q_proj",
    "up_proj",
    "v_proj",
]


@pytest.fixture(scope="module")
def llama_dir(tiny_llama):
    return tiny_llama  # the session's (tests/unit/conftest.py)


@pytest.fixture()
def llama(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir)  # a fresh one: peft wraps it in place


def lora(**overrides) -> ModelConfig:
    return ModelConfig(kind="hf", use_lora=True, lora_rank=4, lora_alpha=8.0, **overrides)


def test_targets():
    assert lora_targets(" all-linear ") == "all-linear"
    assert lora_targets("q_proj, v_proj,,") == ["q_proj", "v_proj"]


def test_all_linear_wraps_every_block_linear_and_freezes_the_base(llama):
    assert linear_names(llama) == LLAMA_LINEARS
    model = apply_lora(llama, lora())
    assert model.peft_config["default"].task_type == "CAUSAL_LM"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # 7 linears in each of the 2 blocks, an A and a B each; the output head stays untouched
    assert len(trainable) == 2 * 7 * 2 and all(
        ".lora_A." in n or ".lora_B." in n for n in trainable
    )
    assert not any("lm_head" in n for n in trainable)


def test_named_targets_and_the_task_type_of_a_speech_model(llama):
    model = apply_lora(llama, lora(lora_target_modules="q_proj,v_proj", task="speech-seq2seq"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 2 * 2 and all(
        ("q_proj" in n) != ("v_proj" in n) for n in trainable
    )
    assert model.peft_config["default"].task_type is None  # the plain wrapper passes every input on


def test_targets_that_match_nothing_name_the_layers_there_are(llama):
    with pytest.raises(ConfigError) as e:
        apply_lora(llama, lora(lora_target_modules="qkv, fc"))
    message = str(e.value)
    assert message.startswith(
        "model.lora_target_modules = 'qkv, fc' matches no module of LlamaForCausalLM ("
    )
    assert message.endswith(
        f"its linear layers are named {', '.join(LLAMA_LINEARS)}; set a "
        "comma-separated list of those, or 'all-linear'"
    )
