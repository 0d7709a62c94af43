"""What a finished run leaves besides its checkpoints: the from_pretrained directory (hf) and a sample (gpt).

`lockstep train` calls this on global rank 0 after run_training returned, so the process group is gone:
slow or failing final writes cannot hold the other ranks. A sharded model's parameters are DTensors of that
group: its full weights come from the checkpoint just committed instead (the same weights, gathered).
"""

from __future__ import annotations

import logging

from lockstep.config import Config
from lockstep.metrics import LOGGER_NAME
from lockstep.train.loop import TrainResult


def write_final_outputs(cfg: Config, result: TrainResult, log: logging.Logger | None = None) -> None:
    """The final outputs of a run that finished (`result.workload` is set on rank 0 of one; else nothing)."""
    wl, log = result.workload, log or logging.getLogger(LOGGER_NAME)
    if wl is None:
        return
    sharded = wl.model is None
    run_dir = result.run_dir
    if wl.finalize is not None:
        if sharded:
            from lockstep.tools.export import export_checkpoint

            out = export_checkpoint(result.checkpoint, run_dir / "final")
        else:
            out = wl.finalize(wl.model.cpu(), run_dir / "final")
        log.info("trained model written for from_pretrained: %s", out)
    if cfg.model.kind == "gpt" and cfg.train.sample_tokens:
        from lockstep.tools.sample import generate_text, load_model_from_checkpoint

        model = load_model_from_checkpoint(result.checkpoint)[0] if sharded else wl.model.cpu()
        result.sample = generate_text(model, wl.tokenizer, "def ", cfg.train.sample_tokens, seed=cfg.train.seed)
        log.info("sample from the trained model:\n%s", result.sample)
