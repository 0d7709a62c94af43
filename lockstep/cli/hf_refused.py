"""Hugging Face TrainingArguments names `lockstep train` refuses: each with the reason and the lockstep way.

lockstep.cli.hf_args translates the names lockstep honours; these stop the command before training instead.
"""

from __future__ import annotations

_FSDP = (
    "lockstep's FSDP is FSDP2, switched on by a config key rather than HF's fsdp options; use "
    "--set parallel.data_parallel=fsdp (resharding: parallel.fsdp_reshard_after_forward)"
)
_HUB = (
    "lockstep does not upload to the Hugging Face Hub; drop it, and after training run `lockstep export "
    "OUTPUT_DIR -o DIR`, which writes a from_pretrained directory to upload"
)
_BEST = (
    "lockstep keeps the last checkpoint.keep_last checkpoints, not a best one; drop it and pick a step by its eval "
    "loss in OUTPUT_DIR/metrics.jsonl"
)
_COMPILE = (
    "lockstep compiles with torch.compile's defaults (inductor); drop it and keep --torch_compile"
)
_EVAL_FILE = (
    "lockstep evaluates on a held-out share of --train_data_file (the last data.eval_fraction of it, default "
    "0.02), not on a separate file; drop it (--set data.eval_fraction=F sets the share)"
)
# HF names refused with the reason and the lockstep way
REFUSED = {
    "deepspeed": "lockstep has no DeepSpeed integration; to shard parameters, gradients and optimizer state it "
    "uses FSDP2: --set parallel.data_parallel=fsdp",
    "fsdp": _FSDP,
    "fsdp_config": _FSDP,
    "fsdp_min_num_params": _FSDP,
    "fsdp_transformer_layer_cls_to_wrap": _FSDP,
    "push_to_hub": _HUB,
    "hub_model_id": _HUB,
    "hub_token": _HUB,
    "hub_strategy": _HUB,
    "hub_private_repo": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "load_best_model_at_end": _BEST,
    "metric_for_best_model": _BEST,
    "greater_is_better": _BEST,
    "torch_compile_backend": _COMPILE,
    "torch_compile_mode": _COMPILE,
    "eval_data_file": _EVAL_FILE,
    "validation_file": _EVAL_FILE,
    "logging_dir": "lockstep writes TensorBoard events to OUTPUT_DIR/tensorboard and metrics to "
    "OUTPUT_DIR/metrics.jsonl; drop it and set --output_dir",
    "run_name": "a lockstep run is named by its --output_dir; drop it",
    "data_seed": "lockstep's data order follows --seed (train.seed); drop it",
    "do_predict": "lockstep train has no prediction pass; drop it and generate from a checkpoint with `lockstep sample`",
    "dataset_name": "lockstep reads local files, not hub datasets; write the dataset as ChatML .jsonl and pass "
    "--train_data_file",
    "auto_find_batch_size": "lockstep does not search for a batch size that fits; set --per_device_train_batch_size",
    "per_gpu_train_batch_size": "this name is deprecated in HF; use --per_device_train_batch_size",
    "per_gpu_eval_batch_size": "this name is deprecated in HF; use --per_device_eval_batch_size",
    "save_only_model": "lockstep checkpoints hold the optimizer and data position for an exact resume; drop it "
    "(`lockstep export` writes the model alone)",
    "tf32": "lockstep leaves TF32 matmuls at PyTorch's default; drop it",
}
# other TrainingArguments names (transformers 4.x and 5.x): refused as having no lockstep equivalent
# (--lr_scheduler_kwargs is read with --lr_scheduler_type cosine_with_min_lr:
# lockstep.cli.hf_values; the HF defaults lockstep behaves as are accepted:
# lockstep.cli.hf_defaults.NOOPS)
OTHER = """optim_args optim_target_modules average_tokens_across_devices label_smoothing_factor
bf16_full_eval fp16_full_eval fp16_opt_level fp16_backend half_precision_backend activation_checkpointing
activation_checkpointing_kwargs gradient_checkpointing_kwargs use_liger_kernel liger_kernel_config use_cache
neftune_noise_alpha torch_empty_cache_steps log_on_each_node logging_nan_inf_filter
include_tokens_per_second log_level_replica project
trackio_space_id eval_delay prediction_loss_only eval_on_start eval_do_concat_batches eval_use_gather_object
eval_accumulation_steps include_for_metrics include_inputs_for_metrics batch_eval_metrics save_on_each_node
enable_jit_checkpoint ignore_data_skip restore_callback_states_from_checkpoint full_determinism
accelerator_config parallelism_config
dataloader_multiprocessing_context dataloader_in_order label_names train_sampling_strategy
group_by_length length_column_name debug skip_memory_metrics use_mps_device
use_ipex jit_mode_eval past_index adafactor tpu_num_cores tpu_metrics_debug torchdynamo ray_scope mp_parameters
use_legacy_prediction_loop push_to_hub_model_id push_to_hub_organization push_to_hub_token""".split()
