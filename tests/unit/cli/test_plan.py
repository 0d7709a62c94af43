"""`lockstep plan` (lockstep/cli/plan.py) as a user runs it: a tiny GPT on 2 nodes of 4 devices, the
same flags as train; --choose; a device too small for the layout (exit 1, the settings that fit); a
layout train refuses (its message, exit 2); a bad world or profile."""

from __future__ import annotations

import re

from conftest import run_main

TINY = ["--hidden-size", 64, "--attention-heads", 4, "--layers", 4, "--max-seq-length", 32]
BATCH = ["--global-batch-size", 32, "--micro-batch-size", 2]


def test_a_plan_for_two_nodes_prints_memory_communication_and_the_step(capsys):
    code, out, err = run_main(
        capsys,
        "plan",
        *TINY,
        *BATCH,
        "--nnodes",
        2,
        "--gpus-per-node",
        4,
        "--set",
        "parallel.data_parallel=fsdp",
    )
    assert code == 0, out + err
    assert "layout dp 8 (fsdp) x tp 1 x pp 1 = world 8 on 2 nodes of 4" in out
    assert "global 32 = dp 8 x micro-batch 2 x 2 accumulation steps, 32 tokens a sample" in out
    assert "device: h100-80gb, 79.1 GiB" in out
    for part in ("parameters", "optimizer", "gathered parameters", "activations", "peak"):
        assert re.search(rf"^  {part} +\d+\.\d\d$", out, re.M), part
    assert re.search(r"^  peak with activation checkpointing +\d+\.\d\d$", out, re.M)
    assert ": fits" in out
    assert re.search(r"all_gather \(parameters\) +8 ranks across nodes", out)
    assert re.search(r"reduce_scatter \(gradients\) +8 ranks across nodes", out)
    assert re.search(r"step \(estimated\): compute [\d.]+ ms .* tokens/s, MFU \d+%", out)


def test_choose_ranks_the_layouts_that_fit_even_when_the_one_asked_for_is_refused(capsys):
    code, out, err = run_main(
        capsys,
        "plan",
        *TINY,
        "--layers",
        2,
        "--max-seq-length",
        16,
        "--global-batch-size",
        8,
        "--micro-batch-size",
        1,
        "--world-size",
        4,
        "--gpus-per-node",
        4,
        "--set",
        "parallel.data_parallel=fsdp",
        "--set",
        "parallel.pipeline_parallel=2",
        "--choose",
    )
    # the layout asked for is train's refusal, and the choice among those it can train stands
    assert code == 2, out + err
    assert out.startswith(
        "the layout asked for is refused: pipeline_parallel(2) on world_size(4) leaves dp = 2 "
        "replicas per stage, and parallel.data_parallel: fsdp does not shard pipeline stages yet"
    )
    found = re.search(r"layouts compared: (\d+) simulated, (\d+) fit", out)
    assert found and int(found[1]) == int(found[2]) >= 10, out
    speeds = [float(s.replace(",", "")) for s in re.findall(r"^ +([\d,]+) tokens/s", out, re.M)]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == 8  # the 8 fastest shown
    # ddp, fsdp twice, fsdp x tp 2, fsdp x tp 4, pp 2 x dp 2, pp 2 x tp 2: each with and without
    # activation checkpointing
    assert int(found[1]) == 14, out
    assert "dp 2 (ddp) x tp 1 x pp 2" in out and "dp 1 (ddp) x tp 2 x pp 2" in out
    # 2 layers: no 4-stage pipeline, and train's words for why
    assert "refused: parallel.pipeline_parallel" not in out and "x pp 4" not in out
    assert re.search(
        r"^best: --set parallel.data_parallel=\w+ --set parallel.tensor_parallel=\d", out, re.M
    )


def test_a_device_too_small_is_refused_with_the_settings_that_fit(capsys, tmp_path):
    small = tmp_path / "small.yaml"
    # 2.0 GiB reserved of 2.01: 10 MiB for tensors
    small.write_text(
        "name: small\nmemory_gib: 2.01\nbf16_tflops: 10\nintra_node_gbs: 10\ninter_node_gbs: 1\n"
    )
    code, out, _ = run_main(
        capsys,
        "plan",
        *TINY,
        "--hidden-size",
        256,
        "--global-batch-size",
        64,
        "--micro-batch-size",
        8,
        "--world-size",
        8,
        "--device-profile",
        small,
    )
    assert code == 1
    assert "does NOT fit" in out
    needs = re.search(r"this layout needs ([\d.]+) GiB per device of 0.0 usable on small", out)
    assert needs and float(needs[1]) > 0.01, out
    fixes = out.split("one setting changed:\n", 1)[1]
    assert "parallel.data_parallel=fsdp: peak" in fixes
    assert "model.gradient_checkpointing=true: peak" in fixes
    assert "train.micro_batch_size=4 (the global batch kept): peak" in fixes


def test_what_train_refuses_plan_refuses_with_the_same_words(capsys, tmp_path):
    code, _, err = run_main(
        capsys,
        "plan",
        *TINY,
        *BATCH,
        "--world-size",
        6,
        "--set",
        "parallel.tensor_parallel=3",
        "--set",
        "parallel.data_parallel=fsdp",
    )
    assert (
        code == 2
        and "model.attention_heads (4) is not divisible by parallel.tensor_parallel (3)" in err
    )
    code, _, err = run_main(
        capsys, "plan", *TINY, *BATCH, "--world-size", 8, "--set", "parallel.pipeline_parallel=8"
    )
    assert code == 2 and "parallel.pipeline_parallel (8) exceeds model.layers (4)" in err
    code, _, err = run_main(capsys, "plan", *TINY, "--global-batch-size", 30, "--world-size", 8)
    assert code == 2 and "global batch 30 is not divisible by world_size(8)" in err
    code, _, err = run_main(capsys, "plan", *TINY, "--device-profile", "b200")
    assert code == 2 and "known: h100-80gb, h200, a100-80gb" in err
    code, _, err = run_main(capsys, "plan", *TINY, "--world-size", 4, "--nnodes", 2)
    assert code == 2 and "--world-size 4 but --nnodes 2 x --gpus-per-node 8 = 16" in err


def test_a_hugging_face_model_is_planned_from_its_config_alone(capsys, tmp_path):
    from transformers import HiggsAudioV2Config, LlamaConfig

    llama = tmp_path / "llama"
    LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    ).save_pretrained(llama)  # fmt: skip
    hf = ["--model-kind", "hf", "--model", llama, "--use-lora", "--max-seq-length", 32]
    code, out, err = run_main(capsys, "plan", *hf, *BATCH, "--world-size", 8)
    assert code == 0, out + err
    assert f"note: Llama from {llama} (config.json only)" in out
    assert "dp 8 (ddp)" in out and "32 tokens a sample" in out and "ESTIMATED" not in out

    higgs = tmp_path / "higgs"
    HiggsAudioV2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, codebook_size=1026,
        audio_token_id=299, audio_bos_token_id=298, audio_delay_token_id=297, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    ).save_pretrained(higgs)  # fmt: skip
    tts = ["--model_path", higgs, "--audio_tokenizer_path", "codec", "--train_data_file", "x.json"]
    code, out, err = run_main(capsys, "plan", *tts, "--use_lora", *BATCH, "--world-size", 8)
    assert code == 0, out + err
    assert "ESTIMATED by formula (lockstep/plan/formula.py), not simulated" in out
    assert "2048 tokens a sample" in out  # the model's own context: train's longest sample
