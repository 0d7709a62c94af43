"""lockstep/train/hf_workload.py on a tiny random Llama saved locally: a ChatML workload's parts (padded
conversations, labels on the assistant's tokens only, a token-weighted loss, tokens counted for MFU,
LoRA checkpoints holding the adapters), a custom-data one with the mean loss, and the data kinds refused."""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from conftest import one_process  # noqa: E402

from lockstep.config import load_config  # noqa: E402
from lockstep.errors import ConfigError  # noqa: E402
from lockstep.train.hf_workload import hf_parts  # noqa: E402

LOG = logging.getLogger("test.train.hf_workload")


def chat_file(path, n: int = 10):
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"count to {k}"},
                {"role": "assistant", "content": " ".join(str(i) for i in range(k + 1))},
            ]
        }
        for k in range(n)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def config(model_dir, data, run, **more):
    return load_config(
        None,
        {
            "model.kind": "hf",
            "model.path": str(model_dir),
            "model.max_seq_length": 64,
            "data.kind": "chatml",
            "data.path": str(data),
            "data.pack": False,
            "data.eval_fraction": 0.2,
            "distributed.device": "cpu",
            "checkpoint.output_dir": str(run),
            **more,
        },
    )


def test_chatml_parts_pad_conversations_and_weigh_the_assistants_tokens(tiny_llama, tmp_path):
    cfg = config(
        tiny_llama,
        chat_file(tmp_path / "chat.jsonl"),
        tmp_path / "run",
        **{"model.use_lora": True, "model.lora_rank": 4},
    )
    parts = hf_parts(cfg, one_process(), tmp_path / "run", LOG)
    assert (len(parts["train_ds"]), len(parts["eval_ds"])) == (8, 2)
    assert "10 conversations (padded)" in parts["describe"] and "(LoRA r=4)" in parts["describe"]
    batch = parts["collate"]([parts["train_ds"][i] for i in range(3)])
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == mask.shape and ids.shape[0] == 3
    # padded: fewer tokens than cells
    assert parts["count_tokens"](batch) == int(mask.sum()) < ids.numel()
    loss = parts["loss"]
    assert loss.token_weighted  # assistant tokens are per-token targets
    targets = loss.count_targets(batch)
    # the user's turns teach nothing
    assert 0 < targets == int((labels[:, 1:] != -100).sum()) < int(mask.sum())
    model = parts["model"]
    with torch.no_grad():
        # alone: the token mean
        torch.testing.assert_close(loss(model, batch, targets), model(**batch).loss)
    assert parts["flops_per_token"] > 0
    assert set(parts["state_dict"]()) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_custom_data_keeps_the_mean_and_other_kinds_are_refused(tiny_llama, tmp_path, write_module):
    module = write_module("""
        import torch

        def build_data():
            return [{"input_ids": torch.arange(5 + i % 3), "labels": torch.arange(5 + i % 3)} for i in range(6)]

        def collate(samples):
            n = max(len(s["input_ids"]) for s in samples)
            pad = lambda t, v: torch.nn.functional.pad(t, (0, n - len(t)), value=v)
            return {"input_ids": torch.stack([pad(s["input_ids"], 0) for s in samples]),
                    "labels": torch.stack([pad(s["labels"], -100) for s in samples])}
    """)
    cfg = config(
        tiny_llama,
        "",
        tmp_path / "run",
        **{
            "data.kind": "custom",
            "data.factory": f"{module}:build_data",
            "data.collate": f"{module}:collate",
        },
    )
    parts = hf_parts(cfg, one_process(), tmp_path / "run", LOG)
    # the model's own mean
    assert not parts["loss"].token_weighted and parts["count_tokens"] is None
    assert "6 samples from" in parts["describe"]
    with pytest.raises(
        ConfigError,
        match=r"model.kind = 'hf' takes data.kind 'chatml', 'audio' or 'custom', "
        r"not 'text'",
    ):
        hf_parts(
            config(tiny_llama, "", tmp_path / "run", **{"data.kind": "text"}),
            one_process(),
            tmp_path,
            LOG,
        )
