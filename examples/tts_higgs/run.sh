#!/usr/bin/env bash
# The TTS team's job on 2 CPU processes: a tiny Higgs Audio v2 + its audio tokenizer (prepare.py), their command
# with `-m lockstep train` in place of their script, then speech out of the trained adapters.
#   bash examples/tts_higgs/run.sh [WORKDIR]      (about a minute on 2 cores)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${1:-runs/tts_higgs}
mkdir -p "$work" && cd "$work"
python "$here/prepare.py" .
export HF_HUB_CACHE=$PWD/hf-cache   # where prepare.py put the two models under their hub ids; lockstep never downloads
# their command, as written, but for three values the tiny stand-in needs to learn in 36 steps:
# --learning_rate 5e-5 -> 1e-2, --warmup_steps 500 -> 5, --logging_steps 50 -> 4
torchrun --nproc_per_node=2 -m lockstep train \
  --model_path bosonai/higgs-audio-v2-generation-3B-base \
  --audio_tokenizer_path bosonai/higgs-audio-v2-tokenizer \
  --train_data_file higgs-audio/training_data/chatml/train_chatml_samples.json \
  --output_dir ./output_expmt_v1 --save_steps 5000 --disable_evaluation \
  --per_device_train_batch_size 2 --learning_rate 1e-2 --num_train_epochs 3 \
  --logging_steps 4 --warmup_steps 5 --bf16 --use_lora
lockstep sample output_expmt_v1 --text "the quick brown fox jumps over the lazy dog" --out sample.wav
