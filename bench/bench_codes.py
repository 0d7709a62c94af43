"""Epoch-2 data time of audio ChatML with the codes cache vs decoding and encoding every clip again.

    python bench/bench_codes.py                  # real-size codec, 12 clips, 2 alternating reps; rewrites its section
    python bench/bench_codes.py --reps 1 --out - # print only

The TTS team's trainer decoded each audio file twice per use (once for the codes, once for the waveform), every
epoch. lockstep decodes and encodes each clip once per job (lockstep.data.codes) and later epochs and runs read
the codes from disk. Both sides here build the same samples (lockstep.data.audio_chatml.TTSDataset items) in one
process, side by side: "cached" reads codes from the cache; "re-encoded" decodes, resamples and encodes each clip
again with the codec, as an uncached pipeline must. The codec has the released layout (DAC acoustic model +
HuBERT-base semantic model, 8 codebooks, 25 frames/s at 24 kHz, ~200M parameters) with random weights: encoding
costs what the real one costs; the codes are meaningless. Clips are 44.1 kHz stereo (mixed down and resampled).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import ROOT, emit_section, machine_info  # noqa: E402

BEGIN = "<!-- bench_codes:begin (written by bench/bench_codes.py; edits between the markers are replaced) -->"
END = "<!-- bench_codes:end -->"


def real_size_codec():
    from transformers import HiggsAudioV2TokenizerConfig

    from lockstep.models.higgs import codec_class

    ratios = [8, 5, 4, 2, 3]  # hop 960: 25 frames/s at 24 kHz, 8 codebooks of 1024 at 2 kbps
    cfg = HiggsAudioV2TokenizerConfig(
        target_bandwidths=[0.5, 1, 1.5, 2],
        acoustic_model_config=dict(downsampling_ratios=ratios, upsampling_ratios=ratios),
    )
    torch.manual_seed(0)
    codec = codec_class()(cfg).eval()
    with torch.no_grad():
        for name, buf in codec.named_buffers():
            if name.endswith("codebook.embed"):
                buf.copy_(torch.randn_like(buf))
    return codec


def main(argv: list[str] | None = None) -> None:
    from lockstep.data.codes import AudioRef, CodesCache, decode_clip
    from lockstep.runtime import Runtime

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clips", type=int, default=12)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument(
        "--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file, or - to print only"
    )
    args = p.parse_args(argv)
    info = machine_info()
    codec = real_size_codec()
    params = sum(q.numel() for q in codec.parameters()) / 1e6
    rate = codec.config.sample_rate
    rng = np.random.default_rng(0)

    @torch.no_grad()
    def encode(wave: np.ndarray) -> np.ndarray:
        return codec.encode(torch.from_numpy(wave)[None, None]).audio_codes[0].numpy()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        refs, seconds = [], 0.0
        for i in range(args.clips):
            length = 1.0 + 2.0 * (i % 3) / 2  # 1, 2, 3 s
            wave = 0.1 * rng.standard_normal((int(44100 * length), 2)).astype(np.float32)
            sf.write(work / f"c{i}.wav", wave, 44100)
            refs.append(AudioRef(str(work / f"c{i}.wav"), None, None, None, f"clip {i}"))
            seconds += length
        from lockstep.data.codes import prepare_codes

        cache = CodesCache(work / "cache", "bench")
        rt = Runtime(0, 0, 1, 1, 0, torch.device("cpu"), None, "none", "h")
        reads = work / "reads.txt"
        t0 = time.perf_counter()
        keys, _ = prepare_codes(refs, cache, encode, rate, rt, read_log=reads)
        first = time.perf_counter() - t0
        decodes_first = len(reads.read_text().split())
        # a second run: everything cached
        prepare_codes(refs, cache, encode, rate, rt, read_log=reads)
        decodes_rerun = len(reads.read_text().split()) - decodes_first

        def cached() -> None:
            for key in keys:
                cache.load(key)

        def reencoded() -> None:
            for ref in refs:
                encode(decode_clip(ref, ref.read_bytes(), rate))

        times: dict[str, list[float]] = {"cached": [], "re-encoded": []}
        for _ in range(args.reps):  # alternating, so drift on this shared machine hits both sides
            for name, fn in (("cached", cached), ("re-encoded", reencoded)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                print(name, times[name][-1], flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    command = "python bench/bench_codes.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        BEGIN,
        "## Audio ChatML: epoch-2 data time with the codes cache vs re-encoding",
        "",
        f"- date: {info['date']}; `{command.strip()}`; lockstep at `{info['commit']}`",
        f"- machine: `{info['arch']}`, {info['cpu']}, {info['cores']} cores (ISA: {info['isa']}); torch {info['torch']}, "
        f"{torch.get_num_threads()} threads",
        f"- codec: HiggsAudioV2TokenizerModel in the released layout, random weights, {params:.0f}M parameters; "
        f"{args.clips} clips of 1-3 s ({seconds:.0f} s of audio), 44.1 kHz stereo; {args.reps} alternating reps",
        f"- decodes: {decodes_first} in the first preparation ({args.clips} clips, each once; {first:.1f} s), "
        f"{decodes_rerun} when a second run prepared the same data",
        "",
        "| epoch 2 data | time (s, median) | per rep (s) | per second of audio (ms) |",
        "|---|---|---|---|",
        *[
            f"| {k} | {med[k]:.3f} | {', '.join(f'{x:.3f}' for x in v)} | {1000 * med[k] / seconds:.1f} |"
            for k, v in times.items()
        ],
        "",
        f"Re-encoded / cached: **{med['re-encoded'] / med['cached']:,.0f}x**.",
        "",
        END,
    ]
    emit_section("\n".join(lines) + "\n", args.out, BEGIN, END)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
