"""What a finished run leaves besides its checkpoints: the from_pretrained directory (hf), a sample (gpt), and
the word error rate on the first FINAL_WER_UTTERANCES of the eval split (hf speech-to-text, RUN/eval/final_wer.json;
`lockstep evaluate` writes RUN/eval/wer.json).

`lockstep train` calls this on global rank 0 after run_training returned, so the process group is gone:
slow or failing final writes cannot hold the other ranks. A sharded model's parameters are DTensors of that
group: its full weights come from the checkpoint just committed instead (the same weights, gathered).
"""

from __future__ import annotations

import logging
from pathlib import Path

from lockstep.config import Config
from lockstep.errors import ConfigError, DataError
from lockstep.models.quantize import is_4bit
from lockstep.rank_logs import LOGGER_NAME
from lockstep.train.loop import TrainResult

# transcribing is a generate() per utterance batch: a bounded cost at the end of a run; `lockstep evaluate RUN`
# scores the whole eval split (or any manifest)
FINAL_WER_UTTERANCES = 64
FINAL_WER_FILE = Path("eval") / "final_wer.json"


def write_final_outputs(
    cfg: Config, result: TrainResult, log: logging.Logger | None = None
) -> None:
    """The final outputs of a run that finished (`result.workload` is set on rank 0 of one; else nothing), then
    the run's trackers (result.trackers, still open) get the final model's path and are closed."""
    trackers, status = result.trackers, "FAILED"
    try:
        final_dir = _write_outputs(cfg, result, log or logging.getLogger(LOGGER_NAME))
        if trackers:  # the from_pretrained directory, else (gpt) the last checkpoint, which `lockstep sample` loads
            trackers.log_final_model(final_dir or result.checkpoint)
        status = "FINISHED"
    finally:
        if trackers:
            trackers.close(status)


def _write_outputs(cfg: Config, result: TrainResult, log: logging.Logger) -> Path | None:
    """The from_pretrained directory (returned, if the workload writes one), the sample, the final WER."""
    wl = result.workload
    if wl is None:
        return None
    sharded = wl.model is None
    run_dir = result.run_dir
    out = None
    if wl.finalize is not None:
        if sharded:
            from lockstep.tools.export import export_checkpoint

            out = export_checkpoint(result.checkpoint, run_dir / "final")
        else:
            # a 4-bit base stays on its GPU: the adapter alone is saved (safetensors copies it to
            # the host), and the packed base would only be copied for nothing
            out = wl.finalize(wl.model if is_4bit(wl.model) else wl.model.cpu(), run_dir / "final")
        log.info("trained model written for from_pretrained: %s", out)
    if cfg.model.kind == "gpt" and cfg.train.sample_tokens:
        from lockstep.tools.sample import generate_text, load_model_from_checkpoint

        model = load_model_from_checkpoint(result.checkpoint)[0] if sharded else wl.model.cpu()
        result.sample = generate_text(
            model, wl.tokenizer, "def ", cfg.train.sample_tokens, seed=cfg.train.seed
        )
        log.info("sample from the trained model:\n%s", printable(result.sample))
    if (
        cfg.data.kind == "audio"
        and cfg.model.task in ("speech-seq2seq", "ctc")
        and wl.eval_ds is not None
    ):
        try:
            write_final_wer(cfg, result, log)
        # the trained model is saved: warn, not fail
        except (ConfigError, DataError, OSError, RuntimeError) as e:
            log.warning(
                "could not compute the WER on the eval split (%s: %s); run `lockstep evaluate %s` to retry",
                type(e).__name__,
                e,
                run_dir,
            )
    return out


def printable(text: str) -> str:
    """`text` for a log file: every character str.isprintable() refuses, but newline and tab,
    written as Python escapes it ("\\x00", "\\x1b", "\\x7f", "\\u2028", a lone surrogate "\\udcff").

    A generated sample can hold any byte: one NUL makes grep call the whole rank log binary, an
    ESC sequence repaints the terminal of whoever reads the log, a "\\r" hides the text before it
    there, a lone surrogate cannot be encoded at all (the log handler would drop the record), and
    the other line breaks str.splitlines knows (\\x0b, \\x1c, \\u2028 ...) look like nothing or like
    a newline that is not one. Newlines and tabs stay: a sample of code spans lines. U+FFFD stays
    too: it is valid UTF-8, and it already marks where the byte tokenizer met bytes that were not.
    Backslashes are not doubled: this is for reading, not for decoding back.
    """
    return "".join(c if c.isprintable() or c in "\n\t" else _escape(c) for c in text)


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def write_final_wer(cfg: Config, result: TrainResult, log: logging.Logger) -> dict:
    """WER of the trained model on the first FINAL_WER_UTTERANCES eval utterances, logged and written to
    RUN/eval/final_wer.json (what `lockstep evaluate RUN --limit N` computes)."""
    import torch

    from lockstep.models.hf import HFProcessor
    from lockstep.tools.evaluate import format_total, save_wer, score_rows
    from lockstep.tools.trained import load_trained_hf, resolve_trained

    wl = result.workload
    eval_rows = wl.eval_ds.rows
    rows = eval_rows[:FINAL_WER_UTTERANCES]
    device = "cuda" if cfg.distributed.device != "cpu" and torch.cuda.is_available() else "cpu"
    if wl.model is None:  # sharded: the weights come from the last checkpoint
        model, processor = load_trained_hf(resolve_trained(result.checkpoint), device)
    else:
        model = wl.model.to(device).eval()
        processor = HFProcessor(wl.eval_ds.tokenizer, wl.eval_ds.feature_extractor)
    scored = score_rows(model, processor, rows)
    what = f"eval split: first {len(rows)} of {len(eval_rows)} utterances"
    wer = {
        "model": str(result.checkpoint),
        "task": cfg.model.task,
        "data": f"{cfg.data.path} ({what})",
        "normalized": True,
        **scored,
    }
    out = save_wer(wer, result.run_dir / FINAL_WER_FILE)
    log.info(
        "the trained model on the eval split: %s (%s); written to %s. `lockstep evaluate %s` scores "
        "all of it, or another manifest with --data",
        format_total(wer),
        what,
        out,
        result.run_dir,
    )
    return wer
