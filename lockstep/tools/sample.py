"""Sample from a trained model: `lockstep sample`, the text at the end of a GPT run, transcripts for WER.

    built-in GPT                continues --prompt                          generate_text
    hf causal-lm / seq2seq-lm   continues --prompt, or with --chat replies  generate_hf_text
    hf speech-seq2seq / ctc     --audio FILE -> its transcript              transcribe
    hf text-to-speech (Higgs)   --text [--reference WAV] -> --out WAV       lockstep.tools.speak

`sample(path, ...)` takes a run, a checkpoint or a model directory (lockstep.tools.trained) and refuses inputs
that do not fit the model (--audio for a text model, none for a speech model) before loading any weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lockstep.checkpoint.plain import Checkpoint
from lockstep.data.tokenizer import tokenizer_from_json
from lockstep.errors import ConfigError, DataError
from lockstep.models.gpt import GPT, build_gpt
from lockstep.tools.export import (
    check_weights_fit,
    checkpoint_config,
    load_verified_checkpoint,
    resolve_checkpoint,
)
from lockstep.tools.trained import TTS_TASK, Trained, load_trained_hf, resolve_trained

SPEECH_TO_TEXT = ("speech-seq2seq", "ctc")
TEXT_TASKS = ("causal-lm", "seq2seq-lm")
DEFAULT_PROMPT, DEFAULT_NEW_TOKENS, DEFAULT_WAV = "def ", 200, "sample.wav"
_FORCED_TOKENS = 4  # Whisper's decoder prompt: start, language, task, no-timestamps
_TRANSCRIBES = ("--audio",), "a speech-to-text model transcribes --audio FILE"
_OPTIONS = {  # task: (the options it takes, what it does with them)
    "gpt": (("--prompt",), "the built-in GPT continues --prompt"),
    "causal-lm": (
        ("--prompt", "--chat"),
        "a text model continues --prompt (with --chat: replies to it)",
    ),
    "seq2seq-lm": (("--prompt",), "a text-to-text model answers --prompt"),
    "speech-seq2seq": _TRANSCRIBES,
    "ctc": _TRANSCRIBES,
    TTS_TASK: (
        ("--text", "--reference", "--out"),
        "a text-to-speech model speaks --text (in the voice of --reference WAV) into --out WAV",
    ),
}


def load_model_from_checkpoint(path: str | Path) -> tuple[GPT, object, Checkpoint]:
    """A checkpoint directory, or a run directory (its newest checkpoint that verifies)."""
    ckpt = load_verified_checkpoint(resolve_checkpoint(path))
    cfg = checkpoint_config(ckpt)
    if cfg.model.kind != "gpt":
        raise ConfigError(
            f"load_model_from_checkpoint builds the built-in GPT, but {ckpt.path} holds model.kind = "
            f"{cfg.model.kind!r}; call lockstep.tools.sample.sample, which loads every kind it can"
        )
    model = build_gpt(cfg.model)
    check_weights_fit(ckpt, model.state_dict())
    model.load_state_dict(ckpt.tensors)
    tokenizer = tokenizer_from_json(ckpt.extra.get("tokenizer.json", b"").decode() or None)
    return model.eval(), tokenizer, ckpt


def generate_text(
    model: GPT,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    ids = tokenizer.encode(prompt) or [0]
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    return tokenizer.decode(out[0].tolist())


def pick_device(device: str = "auto") -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def sample(
    path: str | Path,
    prompt: str | None = None,
    *,
    audio: str | Path | None = None,
    text: str | None = None,
    reference: str | Path | None = None,
    out: str | Path | None = None,
    chat: bool = False,
    max_new_tokens: int | None = None,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    device: str = "auto",
) -> str:
    """What `lockstep sample PATH` prints: generated text, a transcript, or where the speech was written."""
    trained = resolve_trained(path)
    task = _check_inputs(trained, prompt, audio, text, reference, out, chat)
    if task == TTS_TASK:
        return _speak(trained, text, out, reference)
    if trained.cfg.model.kind == "gpt":
        model, tokenizer, _ = load_model_from_checkpoint(trained.path)
        return generate_text(
            model,
            tokenizer,
            DEFAULT_PROMPT if prompt is None else prompt,
            max_new_tokens or DEFAULT_NEW_TOKENS,
            temperature,
            top_k,
            seed,
        )
    model, processor = load_trained_hf(trained, pick_device(device))
    if task in SPEECH_TO_TEXT:
        wave = read_audio_file(audio, processor.feature_extractor.sampling_rate)
        return transcribe(model, processor, [wave], max_new_tokens)[0]
    return generate_hf_text(
        model,
        processor.tokenizer,
        prompt,
        chat,
        max_new_tokens or DEFAULT_NEW_TOKENS,
        temperature,
        top_k,
        seed,
    )


def _check_inputs(trained: Trained, prompt, audio, text, reference, out, chat: bool) -> str:
    """The task to sample with, once the options fit it; ConfigError naming the option and the fix otherwise."""
    what, task = trained.describe(), trained.task or trained.cfg.model.kind

    def refuse(option: str, instead: str) -> None:
        raise ConfigError(f"{option} does not apply to {what}; {instead}")

    if trained.cfg.model.kind == "custom":
        raise ConfigError(
            f"lockstep sample generates with the built-in GPT and Hugging Face models, but {what} holds "
            f"model.kind = 'custom'; write it out with `lockstep export {trained.path} -o DIR` and "
            "run it with your own code"
        )
    if task not in _OPTIONS:  # sequence-classification
        raise ConfigError(
            f"{what} has no output lockstep sample can show (it samples {', '.join(_OPTIONS)}); run it "
            f"with its own code (`lockstep export {trained.path} -o DIR`, then from_pretrained(DIR))"
        )
    given = {
        "--prompt": prompt is not None,
        "--audio": audio is not None,
        "--text": text is not None,
        "--reference": reference is not None,
        "--out": out is not None,
        "--chat": chat,
    }
    allowed, how = _OPTIONS[task]
    for option, is_given in given.items():
        if is_given and option not in allowed:
            refuse(option, how)
    if task in SPEECH_TO_TEXT and audio is None:
        raise ConfigError(f"{what} is a speech-to-text model: pass --audio FILE.wav to transcribe")
    if task == TTS_TASK and not text:
        raise ConfigError(
            f"{what} is a text-to-speech model: pass --text 'what to say' (and --reference WAV for the "
            "voice, --out WAV for where to write it)"
        )
    if chat and prompt is None:
        raise ConfigError("--chat needs --prompt: the user message the model replies to")
    return task


def _speak(
    trained: Trained, text: str, out: str | Path | None, reference: str | Path | None
) -> str:
    if reference is not None and not Path(reference).is_file():
        raise DataError(
            f"--reference {reference} is not a file; pass a WAV file of the voice to speak in, or drop "
            "--reference for the model's default voice"
        )
    try:
        from lockstep.tools.speak import speak_from_checkpoint
    except ImportError as e:
        raise ConfigError(
            f"{trained.describe()} is a text-to-speech model, and this lockstep install cannot speak "
            f"with it ({e}); update lockstep"
        ) from None
    spoken = speak_from_checkpoint(
        trained.path,
        trained.cfg,
        text,
        Path(out or DEFAULT_WAV),
        Path(reference) if reference is not None else None,
    )
    # the path, the length, and whether the model ended the speech or the length cap did
    return spoken.describe()


def generate_hf_text(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | None,
    chat: bool = False,
    max_new_tokens: int = DEFAULT_NEW_TOKENS,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """A causal LM's continuation of `prompt` (prompt included), or with `chat` its reply alone to `prompt` as a
    user message, through the tokenizer's chat template. A seq2seq LM's output for `prompt`."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "--chat needs a chat template, and this model's tokenizer has none "
                "(tokenizer_config.json 'chat_template'); drop --chat to continue --prompt as text"
            )
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
    elif prompt:
        enc = tokenizer(prompt, return_tensors="pt")
    elif tokenizer.bos_token_id is not None:
        enc = {"input_ids": torch.tensor([[tokenizer.bos_token_id]])}
    else:
        raise ConfigError(
            "this tokenizer has no beginning-of-text token to start from; pass --prompt TEXT"
        )
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    options = {"max_new_tokens": max_new_tokens, "pad_token_id": pad, "do_sample": temperature > 0}
    if temperature > 0:
        options.update(temperature=temperature, top_k=top_k or 0)  # top_k 0: no top-k filter
    torch.manual_seed(seed)  # generate() samples from the global generators
    with torch.no_grad(), _quiet_transformers():
        out = model.generate(**inputs, **options)[0]
    if chat and not model.config.is_encoder_decoder:
        out = out[inputs["input_ids"].shape[1] :]  # the reply alone
    return tokenizer.decode(out, skip_special_tokens=True)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """generate() warns about settings of the saved generation_config (max_length beside max_new_tokens, ...) that
    the caller cannot act on; stdout is the text, and stderr stays for lockstep's own messages."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


# ---------------------------------------------------------------- speech to text


def read_audio_file(path: str | Path, rate: int) -> np.ndarray:
    """The file as the float32 mono waveform at `rate` Hz a feature extractor takes; DataError if unreadable."""
    from lockstep.data.audio import decode_audio

    if not Path(path).is_file():
        raise DataError(f"audio file {path} does not exist; pass a WAV (or FLAC / OGG) file")
    try:
        return decode_audio(str(path), rate)
    except ImportError as e:
        raise ConfigError(str(e)) from None
    # soundfile raises LibsndfileError, a RuntimeError
    except (OSError, RuntimeError, ValueError) as e:
        raise DataError(
            f"audio file {path} cannot be decoded ({e}); pass a WAV, FLAC or OGG file that soundfile "
            "reads (convert others, e.g. `ffmpeg -i IN -ar 16000 OUT.wav`)"
        ) from None


def transcribe(
    model: nn.Module,
    processor: Any,
    waves: list[np.ndarray],
    max_new_tokens: int | None = None,
) -> list[str]:
    """One transcript per waveform (at the feature extractor's rate): seq2seq models generate, CTC models take
    the best path. Whisper hears the first chunk_length seconds (30 for the released models) of each."""
    fe, tok = processor.feature_extractor, processor.tokenizer
    device = next(model.parameters()).device
    # CTC: one at a time, so no padding changes what it hears
    if "input_features" not in fe.model_input_names:
        return [_ctc_transcript(model, fe, tok, wave, device) for wave in waves]
    # Whisper's extractor pads every clip to its chunk_length (the encoder takes no other); others pad to the longest
    feats = fe(
        waves,
        sampling_rate=fe.sampling_rate,
        return_tensors="pt",
        **({} if hasattr(fe, "nb_max_frames") else {"padding": True}),
    )
    inputs = {
        "input_features": feats["input_features"].to(device, dtype=model.dtype)
    }  # (B, n_mels, frames)
    if "attention_mask" in feats:
        inputs["attention_mask"] = feats["attention_mask"].to(device)
    limit = getattr(model.config, "max_target_positions", None)
    if limit:  # Whisper refuses max_new_tokens + its decoder prompt > max_target_positions
        max_new_tokens = min(max_new_tokens or limit, limit - _FORCED_TOKENS)
    with torch.no_grad(), _quiet_transformers():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens)
    return [t.strip() for t in tok.batch_decode(out, skip_special_tokens=True)]


def _ctc_transcript(
    model: nn.Module, fe: Any, tok: Any, wave: np.ndarray, device: torch.device
) -> str:
    feats = fe(wave, sampling_rate=fe.sampling_rate, return_tensors="pt")
    with torch.no_grad():
        logits = model(
            feats["input_values"].to(device, dtype=model.dtype)
        ).logits  # (1, frames, vocab)
    ids = logits.argmax(-1)[0].cpu()  # (frames,)
    # Wav2Vec2CTCTokenizer groups repeats and drops blanks itself
    if hasattr(tok, "word_delimiter_token"):
        return tok.decode(ids, skip_special_tokens=True).strip()
    blank = model.config.pad_token_id if model.config.pad_token_id is not None else tok.pad_token_id
    ids = torch.unique_consecutive(ids)  # the best path: repeats merged, then blanks dropped
    return tok.decode(ids[ids != blank], skip_special_tokens=True).strip()
