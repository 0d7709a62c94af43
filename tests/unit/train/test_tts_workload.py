"""lockstep/train/tts_workload.py: a Higgs model + its codec + audio ChatML become a Workload whose trainable state is
the LoRA adapters alone; the codec is in no parameter list; long samples are skipped and counted."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from conftest import one_process

from lockstep.config import load_config
from lockstep.errors import ConfigError, DataError
from lockstep.train.tts_workload import is_tts_model
from lockstep.train.workload import build_workload, unused_settings

log = logging.getLogger("lockstep.test")


def _cfg(tiny, tmp_path, **more):
    sets = {
        "model.kind": "hf",
        "model.path": str(tiny.model),
        "model.audio_tokenizer_path": str(tiny.codec),
        "model.use_lora": True,
        "data.kind": "chatml",
        "data.path": str(tiny.data),
        "data.cache_dir": str(tmp_path / "cache"),
        "data.eval_fraction": 0.25,
        **more,
    }
    return load_config(None, sets)


def test_the_workload_trains_adapters_and_keeps_the_codec_out(tiny_tts, tmp_path):  # noqa: F811
    cfg = _cfg(tiny_tts, tmp_path)
    assert is_tts_model(cfg.model)
    wl = build_workload(cfg, one_process(), tmp_path / "run", log)
    assert type(wl.model.get_base_model()).__name__ == "HiggsAudioV2ForConditionalGeneration"
    names = [n for n, _ in wl.model.named_parameters()]
    # the codec is not in it
    assert not any("codec" in n or "acoustic" in n or "semantic" in n for n in names)
    trainable = {n for n, p in wl.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert set(wl.checkpoint_tensors()) == trainable  # checkpoints hold the adapters only
    assert len(wl.train_ds) == 6 and len(wl.eval_ds) == 2  # eval_fraction 0.25 of 8
    batch = wl.collate([wl.train_ds[i] for i in range(2)])
    loss = wl.loss(wl.model, batch)
    assert torch.isfinite(loss) and wl.loss.token_weighted and wl.loss.count_targets(batch) > 0
    assert "codec" in wl.describe and "frozen" in wl.describe and "8 clips" in wl.describe
    out = wl.finalize(wl.model, tmp_path / "final")
    info = json.loads((out / "lockstep.json").read_text())
    assert info["format"] == "adapter" and info["audio_tokenizer_path"] == str(
        tiny_tts.codec.resolve()
    )
    assert not (out / "model.safetensors").exists()  # the codec and the base are saved by reference


def test_long_samples_are_skipped_and_counted(tiny_tts, tmp_path, caplog):  # noqa: F811
    no_eval = {"data.eval_fraction": 0}
    lengths = sorted(
        build_workload(
            _cfg(tiny_tts, tmp_path, **no_eval), one_process(), tmp_path / "r", log
        ).train_ds.lengths()
    )
    limit = int(lengths[4])  # the 3 longest samples are longer
    with caplog.at_level(logging.WARNING, logger="lockstep.test"):
        wl = build_workload(
            _cfg(tiny_tts, tmp_path, **{"model.max_seq_length": limit, **no_eval}),
            one_process(),
            tmp_path / "run",
            log,
        )
    skipped = sum(n > limit for n in lengths)
    assert len(wl.train_ds) == 8 - skipped and skipped >= 3
    assert f"{skipped} of 8 samples are longer than model.max_seq_length = {limit}" in caplog.text
    assert max(wl.train_ds.lengths()) <= limit
    with pytest.raises(
        DataError, match="no sample of .* is left to train on .8 longer than model.max_seq_length"
    ):
        build_workload(
            _cfg(tiny_tts, tmp_path, **{"model.max_seq_length": 10}),
            one_process(),
            tmp_path / "r",
            log,
        )


def test_bad_input_before_training(tiny_tts, tmp_path):  # noqa: F811
    cfg = _cfg(tiny_tts, tmp_path)
    cfg.model.audio_tokenizer_path = None
    assert is_tts_model(cfg.model)  # known from config.json alone
    with pytest.raises(ConfigError, match="set model.audio_tokenizer_path"):
        build_workload(cfg, one_process(), tmp_path / "run", log)
    cfg = _cfg(tiny_tts, tmp_path, **{"model.audio_tokenizer_path": str(tiny_tts.model)})
    with pytest.raises(ConfigError, match="not a Higgs Audio v2 tokenizer"):
        build_workload(cfg, one_process(), tmp_path / "run", log)
    # a missing wav: stopped with its name, or skipped and counted
    data = tmp_path / "data"
    shutil.copytree(tiny_tts.data.parent, data)
    (data / "wavs" / "utt3.wav").unlink()
    cfg = _cfg(tiny_tts, tmp_path, **{"data.path": str(data / tiny_tts.data.name)})
    with pytest.raises(DataError, match=r"utt3.wav .*sample 3.*data.bad_audio: skip"):
        build_workload(cfg, one_process(), tmp_path / "run", log)
    cfg.data.bad_audio = "skip"
    wl = build_workload(cfg, one_process(), tmp_path / "run", log)
    assert len(wl.train_ds) + len(wl.eval_ds) == 7


def test_the_tts_keys_count_as_read(tiny_tts, tmp_path):  # noqa: F811
    cfg = _cfg(tiny_tts, tmp_path, **{"data.log_reads": True, "data.bad_audio": "skip"})
    assert unused_settings(cfg) == []
    cfg = load_config(
        None,
        {
            "data.cache_dir": "/x",
            "data.kind": "chatml",
            "model.kind": "hf",
            "model.path": "m",
            "data.path": "d.json",
        },
    )
    # plain chatml caches nothing
    assert any("data.cache_dir" in line for line in unused_settings(cfg))


def _tts_step(rt, model_dir: str, micro_batches: list, counted: bool) -> tuple[float, dict]:
    """One train_step of the whole Higgs model under DDP over rt's ranks: (the loss it returns, the final gradients)."""
    from lockstep.config import ModelConfig
    from lockstep.data.audio_chatml import count_audio_targets
    from lockstep.models.higgs import build_higgs_model, higgs_forward_loss
    from lockstep.models.loss import Loss
    from lockstep.parallel.ddp import apply_ddp
    from lockstep.train.step import train_step

    torch.manual_seed(0)
    model = build_higgs_model(ModelConfig(kind="hf", path=model_dir))
    # the workload's, or a mean
    loss = Loss(higgs_forward_loss, count_audio_targets if counted else None)
    ddp = apply_ddp(model, rt, loss, find_unused_parameters=True)
    grads: dict[str, torch.Tensor] = {}

    def keep_grads():
        grads.update(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )

    value, _ = train_step(
        ddp,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        micro_batches,
        rt,
        grad_accum=len(micro_batches),
        loss=loss,
        after_backward=keep_grads,
    )
    return float(value), grads


def _tts_on_two_ranks(rt, model_dir: str, per_rank: list) -> tuple:
    return [_tts_step(rt, model_dir, per_rank[rt.rank], counted) for counted in (True, False)]


def test_audio_accumulation_on_two_ranks_equals_one_batch(tiny_tts, tmp_path):  # noqa: F811
    from conftest import run_ranks

    from lockstep.data.audio_chatml import count_audio_targets

    wl = build_workload(
        _cfg(tiny_tts, tmp_path, **{"data.eval_fraction": 0}), one_process(), tmp_path / "r", log
    )
    items = [wl.train_ds[i] for i in range(8)]
    per_rank = [
        [wl.collate(items[4 * r + 2 * j : 4 * r + 2 * j + 2]) for j in range(2)] for r in range(2)
    ]
    counts = [count_audio_targets(b) for rank in per_rank for b in rank]
    # the clips differ in length, so the micro-batches in targets
    assert len(set(counts)) > 1, counts
    ref_loss, ref_grads = _tts_step(
        one_process(), str(tiny_tts.model), [wl.collate(items)], counted=True
    )
    (counted_0, old_0), (counted_1, _) = run_ranks(_tts_on_two_ranks, str(tiny_tts.model), per_rank)
    assert abs((counted_0[0] + counted_1[0]) / 2 - ref_loss) < 1e-5 * ref_loss, (
        counted_0[0],
        counted_1[0],
        ref_loss,
    )
    for name, ref in ref_grads.items():
        torch.testing.assert_close(counted_0[1][name], ref, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(counted_1[1][name], ref, rtol=1e-4, atol=1e-6, msg=name)
    # a mean of micro-batch means trains on another objective
    differs = max(
        float((old_0[1][n] - ref_grads[n]).norm() / ref_grads[n].norm())
        for n in ref_grads
        if ref_grads[n].norm() > 0
    )
    assert differs > 0.01, differs
