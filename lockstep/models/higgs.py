"""Higgs Audio v2 text-to-speech: the LLM (HiggsAudioV2ForConditionalGeneration) and its codec, from local directories.

    load_codec(path)            HiggsAudioV2TokenizerModel, frozen: eval mode, no gradients, never optimized,
                                never wrapped by DDP, saved in no checkpoint (a run records its path only)
    build_higgs_model(cfg)      the LLM, in cfg.dtype, with activation checkpointing and LoRA as configured
    check_codec(model, codec)   the codec's codes fit the model's audio head (before any sample is encoded)
    higgs_forward_loss          model(**batch).loss: the sum over the codebooks of each codebook's loss
    synthesize(...)             text (and optionally a reference voice) -> a waveform at the
                                codec's rate, and whether the model ended it or the frame cap did

transformers' codec module imports torchaudio at the top and uses it for one call only,
`torchaudio.functional.resample` (24 kHz -> the semantic model's 16 kHz). The package registries this
project installs from have no torchaudio build for torch 2.13, while GPU clusters ship one; so when
torchaudio cannot be imported, `use_torchaudio_or_fallback` registers a stand-in module whose
`functional.resample` is soxr (already lockstep's resampler for audio data), and logs that it did.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import sys
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lockstep.config import ModelConfig
from lockstep.errors import ConfigError

HIGGS_MODEL_TYPE, CODEC_MODEL_TYPE = "higgs_audio_v2", "higgs_audio_v2_tokenizer"
log = logging.getLogger("lockstep")


# ---------------------------------------------------------------- torchaudio


def _soxr_resample(waveform: torch.Tensor, orig_freq: int, new_freq: int, **_: Any) -> torch.Tensor:
    """torchaudio.functional.resample's contract (..., time) -> (..., time'), computed by soxr on the CPU.

    Only ever called on the frozen codec's input under no_grad, so leaving autograd is harmless.
    """
    import soxr

    array = waveform.detach().to("cpu", torch.float32).numpy()
    rows = array.reshape(-1, array.shape[-1])
    out = np.stack([soxr.resample(row, orig_freq, new_freq) for row in rows])
    return torch.from_numpy(out.reshape(*array.shape[:-1], out.shape[-1])).to(
        waveform.device, waveform.dtype
    )


def use_torchaudio_or_fallback() -> str:
    """'torchaudio' when the real package imports; otherwise registers the soxr stand-in and says so."""
    stand_in = sys.modules.get("torchaudio")
    if stand_in is not None:
        return getattr(stand_in, "__lockstep_fallback__", "torchaudio")
    try:
        importlib.import_module("torchaudio")
        return "torchaudio"
    # not installed, or built for another torch (an ABI error is an OSError/ImportError)
    except Exception as e:
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    module = types.ModuleType("torchaudio")
    # a real spec, so importlib.util.find_spec (transformers' backend check) sees an installed package
    module.__spec__ = importlib.machinery.ModuleSpec("torchaudio", loader=None)
    module.__version__ = "0+lockstep.soxr"
    module.__lockstep_fallback__ = "soxr"
    functional = types.ModuleType("torchaudio.functional")
    functional.__spec__ = importlib.machinery.ModuleSpec("torchaudio.functional", loader=None)
    functional.resample = _soxr_resample
    module.functional = functional
    sys.modules["torchaudio"], sys.modules["torchaudio.functional"] = module, functional
    # it caches "is torchaudio installed?" from its first question
    if "transformers" in sys.modules:
        from transformers.utils import import_utils

        import_utils.is_torchaudio_available.cache_clear()
    log.info(
        "torchaudio could not be imported (%s); the Higgs codec's resampling to its semantic model's rate "
        "runs through soxr instead (install torchaudio matching your torch to use its resampler)",
        reason,
    )
    return "soxr"


# ---------------------------------------------------------------- loading


def _config_of(path: str, display: str, key: str) -> Any:
    from lockstep.models.hf import load_hf_config, resolve_hf_path

    local, _ = resolve_hf_path(path)
    try:
        return local, load_hf_config(local, display)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


def codec_class() -> type:
    """HiggsAudioV2TokenizerModel, imported from its own module.

    `from transformers import ...` would hand out a placeholder that raises: transformers decides which
    classes lack a backend once, when it is first imported, which may be before the fallback exists.
    """
    use_torchaudio_or_fallback()
    module = importlib.import_module(
        "transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer"
    )
    return module.HiggsAudioV2TokenizerModel


def load_codec(path: str, device: torch.device | str = "cpu") -> nn.Module:
    """The audio tokenizer at `path`, frozen (eval, requires_grad False) on `device`."""
    local, config = _config_of(path, path, "model.audio_tokenizer_path")
    if config.model_type != CODEC_MODEL_TYPE:
        raise ConfigError(
            f"model.audio_tokenizer_path = {path!r} holds a {config.model_type!r} model, not a Higgs "
            f"Audio v2 tokenizer ({CODEC_MODEL_TYPE!r}); point it at the codec directory "
            "(e.g. a local copy of bosonai/higgs-audio-v2-tokenizer)"
        )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    codec = codec_class().from_pretrained(local, local_files_only=True)
    codec.requires_grad_(False)
    return codec.eval().to(device)


def is_higgs(config: Any) -> bool:
    return getattr(config, "model_type", None) == HIGGS_MODEL_TYPE


def check_higgs_options(cfg: ModelConfig) -> None:
    """The model options a Higgs model refuses: its codec and audio heads are untested in 4-bit."""
    if cfg.load_in_4bit:
        raise ConfigError(
            "model.load_in_4bit is not supported for the Higgs Audio v2 text-to-speech model; "
            "drop --load-in-4bit (LoRA on the bf16 base: --use-lora --set model.dtype=bfloat16)"
        )


def build_higgs_model(cfg: ModelConfig) -> nn.Module:
    """HiggsAudioV2ForConditionalGeneration from cfg.path, with checkpointing and LoRA as configured."""
    from lockstep.models.hf import apply_training_options

    check_higgs_options(cfg)
    local, config = _config_of(cfg.path, cfg.path, "model.path")
    if not is_higgs(config):
        raise ConfigError(
            f"model.path = {cfg.path!r} is a {config.model_type!r} model; text-to-speech with an audio "
            f"tokenizer (model.audio_tokenizer_path) needs a Higgs Audio v2 model ({HIGGS_MODEL_TYPE!r})"
        )
    from transformers import HiggsAudioV2ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = HiggsAudioV2ForConditionalGeneration.from_pretrained(
        local, dtype=getattr(torch, cfg.dtype), local_files_only=True
    )
    return apply_training_options(model, cfg)


def check_codec(model_config: Any, codec: nn.Module, model_path: str, codec_path: str) -> None:
    """The codec's codebooks fit the model's audio head: as many codebooks, and room for the stream bos/eos codes."""
    c, m = codec.config, model_config
    if c.num_quantizers != m.num_codebooks:
        raise ConfigError(
            f"model.audio_tokenizer_path = {codec_path!r} encodes {c.num_quantizers} codebooks, but "
            f"model.path = {model_path!r} predicts {m.num_codebooks}; use the codec the model was "
            "trained with"
        )
    special = sorted({m.audio_stream_bos_id, m.audio_stream_eos_id})
    if c.codebook_size > special[0] or special[-1] >= m.codebook_size:
        raise ConfigError(
            f"the codec has {c.codebook_size} codes per codebook, and the model's audio head has "
            f"{m.codebook_size} with stream bos/eos codes {m.audio_stream_bos_id}/"
            f"{m.audio_stream_eos_id}: the head needs the codec's codes plus those two (codebook_size "
            f"{c.codebook_size + 2}); use a model made for this codec"
        )


def higgs_forward_loss(
    model: nn.Module, batch: dict[str, Any], num_items: int | None = None
) -> torch.Tensor:
    """The model's own loss: per-codebook cross-entropy, summed over the codebooks.

    With `num_items` (the Loss's divisor: the step's target count per codebook), each codebook's loss is
    its token sum over that count (transformers' `num_items_in_batch`), so accumulation equals one big batch.
    """
    loss = model(
        **batch, **({"num_items_in_batch": num_items} if num_items is not None else {})
    ).loss
    if loss is None:
        raise ConfigError(
            f"the Higgs model returned no loss for a batch with keys {sorted(batch)}; a batch needs "
            "audio_labels (lockstep.data.audio_chatml builds them from assistant audio)"
        )
    return loss


# ---------------------------------------------------------------- speech out


@dataclass
class Speech:
    wave: torch.Tensor  # (samples,) float32 at the codec's rate
    ended: bool  # the model emitted end-of-speech; False: generation stopped at max_new_frames


@torch.no_grad()
def synthesize(
    model: nn.Module,
    codec: nn.Module,
    tokenizer: Any,
    prompt_ids: list[int],
    reference_frames: torch.Tensor | None = None,
    max_new_frames: int = 500,
    do_sample: bool = False,
    temperature: float = 1.0,
) -> Speech:
    """Generate audio codes after `prompt_ids` (which end with <|audio_out_bos|>) and decode them to a waveform.

    `reference_frames`: delayed code frames (frames, codebooks) of the audio placeholders in the prompt
    (a reference voice), or None. Greedy or sampling: the only modes transformers' Higgs generation supports.
    Speech.ended tells a finished utterance from one cut at the cap: transformers' generation ends
    the stream with an all-eos frame once one codebook emits the stream-eos code, and only then.
    """
    device = next(model.parameters()).device
    inputs: dict[str, Any] = {"input_ids": torch.tensor([prompt_ids], device=device)}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if reference_frames is not None:
        inputs["audio_input_ids"] = reference_frames[None].to(device)
        inputs["audio_input_ids_mask"] = torch.ones(
            1, reference_frames.shape[0], dtype=torch.bool, device=device
        )
    kwargs = {"do_sample": True, "temperature": temperature} if do_sample else {"do_sample": False}
    # (frames, codebooks)
    frames = model.generate(**inputs, max_new_tokens=max_new_frames, **kwargs)[0].cpu()
    # the reference frames come back first; they end with an all-eos frame of their own
    new = frames[0 if reference_frames is None else reference_frames.shape[0] :]
    ended = bool((new == model.config.audio_stream_eos_id).all(-1).any())
    return Speech(decode_frames(frames, codec, model.config), ended)


def decode_frames(frames: torch.Tensor, codec: nn.Module, config: Any) -> torch.Tensor:
    """Delayed frames (frames, codebooks), from the last all-bos frame to the first all-eos frame -> waveform."""
    bos, eos, k = config.audio_stream_bos_id, config.audio_stream_eos_id, config.num_codebooks
    starts = (frames == bos).all(-1).nonzero()
    frames = frames[int(starts[-1]) + 1 :] if len(starts) else frames
    ends = (frames == eos).all(-1).nonzero()
    frames = frames[: int(ends[0])] if len(ends) else frames
    if frames.shape[0] <= k:
        return torch.zeros(0)
    # undo the delay: codebook i is shifted right by i frames
    # (codebooks, T)
    codes = torch.stack([frames[i : frames.shape[0] - (k - 1) + i, i] for i in range(k)])
    codes = codes.clamp(0, codec.config.codebook_size - 1)
    device = next(codec.parameters()).device
    return codec.decode(codes[None].to(device)).audio_values.detach().float().cpu().reshape(-1)
