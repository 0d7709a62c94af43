"""Audio ChatML in the Higgs Audio project's format -> token ids, audio code frames and their labels.

    load_tts_samples(path)      .json (a list of samples) / .jsonl / a folder or glob of them -> TTSSample list;
                                a sample is {"messages": [{"role", "content"}], "start_index"?, "speaker"?, "misc"?},
                                content a string, a part, or a list of strings and parts; parts are
                                {"type": "text", "text"} or {"type": "audio", "audio_url" | "raw_audio",
                                "offset"?, "duration"?}; audio_url relative to the JSON file
    TTSDataset                  per sample: Llama-3 headers and text tokens; each clip's codes (lockstep.data.codes)
                                with stream bos/eos codes in the delay pattern, behind as many audio placeholder
                                tokens as it has frames; assistant clips (from start_index on) are labels
    collate_tts(...)            right-pads tokens and frames into the batch HiggsAudioV2ForConditionalGeneration takes

Clip labels follow the Higgs project's collator: the codes and the stream-eos code (so the model learns to stop);
the stream-bos code and the delay padding are -100. Every codebook then has the same number of targets, which
is what lets the loss be normalized by one count per step (lockstep.train.step). Audio in system or user turns
(a reference voice) is input only. A sample longer than model.max_seq_length is skipped and counted: cutting
one would cut a clip's codes mid-stream.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lockstep.data.codes import AudioRef, CodesCache
from lockstep.data.files import list_data_files
from lockstep.errors import DataError

IGNORE = -100
ROLES = ("system", "user", "assistant", "scene")
EXAMPLE = (
    '{"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": '
    '{"type": "audio", "audio_url": "wavs/hello.wav"}}]}'
)
log = logging.getLogger("lockstep")


@dataclass
class TTSSample:
    turns: list[tuple[str, list[str | AudioRef], bool]]  # (role, parts, learned?) in order
    source: str  # "file.json:sample N"
    speaker: str | None = None


@dataclass(frozen=True)
class HiggsTokens:
    """The token ids a Higgs tokenizer gives its special tokens, and the model's stream codes."""

    audio_bos: int  # <|audio_out_bos|>
    audio: int  # <|AUDIO_OUT|>: a frame's placeholder
    delay: int  # the delay-pattern placeholder of the last codebooks-1 frames
    audio_eos: int  # <|audio_eos|>
    pad: int
    codebooks: int
    stream_bos: int
    stream_eos: int

    @classmethod
    def of(cls, tokenizer: Any, config: Any) -> HiggsTokens:
        named = {
            "<|audio_out_bos|>": config.audio_bos_token_id,
            "<|AUDIO_OUT|>": config.audio_token_id,
            "<|audio_eos|>": None,
        }
        found = {t: tokenizer.convert_tokens_to_ids(t) for t in named}
        if any(v is None or v == tokenizer.unk_token_id for v in found.values()):
            raise DataError(
                "the model's tokenizer lacks the Higgs audio tokens (<|audio_out_bos|>, <|AUDIO_OUT|>, "
                "<|audio_eos|>); set model.path to a Higgs Audio v2 model directory, tokenizer included"
            )
        wrong = [
            f"{t} is {found[t]} in the tokenizer, {v} in config.json"
            for t, v in named.items()
            if v is not None and found[t] != v
        ]
        if wrong:
            raise DataError(
                f"the tokenizer and the model config disagree: {'; '.join(wrong)}; save the tokenizer that "
                "belongs to this model beside it"
            )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.pad_token_id
        return cls(
            config.audio_bos_token_id,
            config.audio_token_id,
            config.audio_delay_token_id,
            found["<|audio_eos|>"],
            pad,
            config.num_codebooks,
            config.audio_stream_bos_id,
            config.audio_stream_eos_id,
        )


# ---------------------------------------------------------------- loading and validation


def load_tts_samples(path: str, max_files: int | None = None) -> list[TTSSample]:
    samples: list[TTSSample] = []
    for file in list_data_files(path, (".json", ".jsonl"), max_files, what="audio ChatML"):
        text = file.read_text(encoding="utf-8")
        if file.suffix == ".jsonl":
            records = [
                (f"{file}:{n}", line) for n, line in enumerate(text.splitlines(), 1) if line.strip()
            ]
            for where, line in records:
                try:
                    samples.append(_parse_sample(json.loads(line), where, file.parent))
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{where} is not valid JSON ({e.msg}); each line holds one sample, e.g. "
                        f"{EXAMPLE}"
                    ) from None
            continue
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{file} is not valid JSON ({e.msg} at line {e.lineno}); a .json file holds a list of "
                f"samples like {EXAMPLE}"
            ) from None
        for n, record in enumerate(loaded if isinstance(loaded, list) else [loaded]):
            samples.append(_parse_sample(record, f"{file}:sample {n}", file.parent))
    if not samples:
        raise DataError(f"data.path = {path!r} holds no samples; write samples like {EXAMPLE}")
    return samples


def _parse_sample(record: Any, where: str, base: Path) -> TTSSample:
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("messages"), list)
        or not record["messages"]
    ):
        raise DataError(
            f"{where}: a sample is an object with a non-empty 'messages' list; got "
            f"{json.dumps(record)[:120]}; write it like {EXAMPLE}"
        )
    start = record.get("start_index") or 0
    turns, learned_audio = [], 0
    for t, message in enumerate(record["messages"]):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise DataError(f"{where}, message {t}: role {role!r} is not one of {', '.join(ROLES)}")
        parts = [
            _parse_part(p, f"{where}, message {t}", base) for p in _as_list(message.get("content"))
        ]
        learned = role == "assistant" and t >= start
        learned_audio += learned * sum(isinstance(p, AudioRef) for p in parts)
        turns.append((role, parts, learned))
    if not learned_audio:
        raise DataError(
            f"{where}: no assistant audio to learn (assistant turns from start_index = {start} on hold "
            "no audio part); a text-to-speech sample needs an assistant turn like "
            '{"role": "assistant", "content": {"type": "audio", "audio_url": "wavs/x.wav"}}'
        )
    speaker = record.get("speaker") or (record.get("misc") or {}).get("speaker")
    return TTSSample(turns, where, speaker)


def _as_list(content: Any) -> list:
    if content is None:
        return []
    return content if isinstance(content, list) else [content]


def _parse_part(part: Any, where: str, base: Path) -> str | AudioRef:
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "audio":
        url, raw = part.get("audio_url"), part.get("raw_audio")
        if not url and not raw:
            raise DataError(
                f"{where}: an audio part needs audio_url (a path, relative to the JSON file) or raw_audio "
                f"(base64 bytes); got {json.dumps(part)[:120]}"
            )
        path = None if raw else str((base / url).resolve()) if not Path(url).is_absolute() else url
        return AudioRef(path, raw or None, part.get("offset"), part.get("duration"), where)
    raise DataError(
        f"{where}: a content part is a string, {{'type': 'text', 'text': ...}} or {{'type': 'audio', "
        f"'audio_url': ...}}; got {json.dumps(part)[:120]}"
    )


def audio_refs(samples: list[TTSSample]) -> list[AudioRef]:
    return [p for s in samples for _, parts, _ in s.turns for p in parts if isinstance(p, AudioRef)]


# ---------------------------------------------------------------- tokens and frames


def delayed(codes: np.ndarray, tokens: HiggsTokens, learned: bool) -> tuple[np.ndarray, np.ndarray]:
    """(frames, labels), each (T + codebooks + 1, codebooks): bos + codes + eos, codebook i shifted by i frames."""
    k, t = codes.shape
    n = t + k + 1
    frames = np.full((k, n), tokens.stream_eos, dtype=np.int64)
    labels = np.full((k, n), IGNORE, dtype=np.int64)
    for i in range(k):
        frames[i, : i + 1] = tokens.stream_bos
        frames[i, i + 1 : i + 1 + t] = codes[i]
        if learned:
            labels[i, i + 1 : i + 1 + t] = codes[i]
            labels[i, i + 1 + t] = tokens.stream_eos  # the stop the model must learn
    return frames.T, labels.T


@dataclass
class _Encoded:
    # tokens or clip key
    pieces: list[tuple[np.ndarray, bool] | tuple[str, bool]] = field(default_factory=list)
    length: int = 0


def encode_sample(
    sample: TTSSample,
    keys: dict[AudioRef, str | None],
    cache: CodesCache,
    tokenizer: Any,
    tokens: HiggsTokens,
) -> _Encoded | None:
    """The sample's token pieces and clip keys in order; None when one of its clips was dropped (bad_audio skip)."""
    out = _Encoded()

    def text(s: str, learned: bool) -> None:
        ids = np.asarray(tokenizer.encode(s, add_special_tokens=False), dtype=np.int64)
        out.pieces.append((ids, learned))
        out.length += len(ids)

    for t, (role, parts, learned) in enumerate(sample.turns):
        text(
            ("<|begin_of_text|>" if t == 0 else "")
            + f"<|start_header_id|>{role}<|end_header_id|>\n\n",
            False,
        )
        for part in parts:
            if isinstance(part, str):
                text(part, learned)
                continue
            key = keys.get(part)
            if key is None:
                return None
            out.pieces.append((key, learned))
            # frames, plus audio bos/eos tokens
            out.length += cache.frames(key) + tokens.codebooks + 1 + 2
        text("<|eot_id|>", learned)
    return out


class TTSDataset(Dataset):
    """Encoded samples -> {"input_ids", "frames", "audio_labels"}; codes are read from the cache."""

    def __init__(self, encoded: list[_Encoded], cache: CodesCache, tokens: HiggsTokens):
        self.encoded, self.cache, self.tokens = encoded, cache, tokens

    def __len__(self) -> int:
        return len(self.encoded)

    def lengths(self) -> np.ndarray:
        return np.array([e.length for e in self.encoded], dtype=np.float64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tk = self.tokens
        ids, frames, frame_labels = [], [], []
        for piece, learned in self.encoded[i].pieces:
            if isinstance(piece, str):
                f, fl = delayed(self.cache.load(piece).astype(np.int64), tk, learned)
                n = f.shape[0]
                placeholders = [tk.audio] * (n - (tk.codebooks - 1)) + [tk.delay] * (
                    tk.codebooks - 1
                )
                ids += [tk.audio_bos, *placeholders, tk.audio_eos]
                frames.append(f)
                frame_labels.append(fl)
            else:
                ids += piece.tolist()
        return {
            "input_ids": torch.tensor(ids),
            "frames": torch.from_numpy(np.concatenate(frames)),
            "audio_labels": torch.from_numpy(np.concatenate(frame_labels)),
        }


class TTSCollator:
    """Right-pads: tokens with pad (attention 0), frames with the stream-eos code (mask False, labels -100).

    No text labels: transformers builds the model without its optional text head (the released checkpoint has
    no weights for one), so the loss is the audio codebooks' alone.
    """

    def __init__(self, tokens: HiggsTokens):
        self.tokens = tokens

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        tk, b = self.tokens, len(samples)
        length = max(len(s["input_ids"]) for s in samples)
        frames = max(len(s["frames"]) for s in samples)
        batch = {
            "input_ids": torch.full((b, length), tk.pad),
            "attention_mask": torch.zeros(b, length, dtype=torch.long),
            "audio_input_ids": torch.full((b, frames, tk.codebooks), tk.stream_eos),
            "audio_input_ids_mask": torch.zeros(b, frames, dtype=torch.bool),
            "audio_labels": torch.full((b, frames, tk.codebooks), IGNORE),
        }
        for i, s in enumerate(samples):
            n, f = len(s["input_ids"]), len(s["frames"])
            batch["input_ids"][i, :n] = s["input_ids"]
            batch["attention_mask"][i, :n] = 1
            batch["audio_input_ids"][i, :f] = s["frames"]
            batch["audio_input_ids_mask"][i, :f] = True
            batch["audio_labels"][i, :f] = s["audio_labels"]
        return batch


def count_audio_targets(batch: dict[str, torch.Tensor]) -> int:
    """Targets per codebook (the same for every codebook): what the step's loss is normalized by."""
    return int((batch["audio_labels"][..., 0] != IGNORE).sum())


def count_batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["attention_mask"].sum())
