#!/usr/bin/env bash
# Download the wheels the GPU machine lacks, on a machine that reaches PyPI, for
# `bash bench/gpu/run.sh --wheels DIR`.
#
#   bash bench/gpu/fetch_wheels.sh [DIR]    # default .whl; keep it out of git:
#                                           #   echo /.whl/ >> .git/info/exclude
#
# The GPU machine (Python 3.12, torch 2.11 + CUDA 13, transformers 5.17, no network) lacks:
#   transformers 5.23.0  the first release with Higgs Audio v2; of its dependencies only regex
#                        may be too old there (huggingface-hub, tokenizers, safetensors are not)
#   soundfile, soxr, jiwer, rapidfuzz   lockstep[audio]: decode, resample, WER;
#                        soundfile needs cffi (and cffi pycparser), which that machine lacks
#   bitsandbytes 0.50.2  the 4-bit library for QLoRA (~43 MB, the largest)
# Binary wheels for CPython 3.12 on manylinux x86_64, without dependencies (each one is named
# here). The total must stay under 64 MiB, what the device tool carries with the tree in one call.
set -euo pipefail
dir="${1:-.whl}"
python="${LOCKSTEP_PYTHON:-python3}"
wheels=(transformers==5.23.0 regex==2026.11.19 soundfile==0.14.0 soxr==1.1.0 jiwer==4.0.0
        rapidfuzz==3.14.6 cffi==2.1.1 pycparser==3.12 bitsandbytes==0.50.2)
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28; do
    platforms+=(--platform "${tag}_x86_64")
done
mkdir -p "$dir"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dir" "${wheels[@]}"
# two versions of one package make `pip install DIR/*.whl` refuse the whole folder
dupes=$(ls "$dir"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "fetch_wheels.sh: $dir holds several versions of: $dupes; delete the older ones" >&2
    exit 1
fi
bytes=$(cat "$dir"/*.whl | wc -c)
count=$(ls "$dir"/*.whl | wc -l)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "fetch_wheels.sh: $count wheels in $dir, $mib MiB in all (limit 64 MiB)"
if [ "$bytes" -gt $((64 * 1024 * 1024)) ]; then
    echo "fetch_wheels.sh: over 64 MiB, more than the device tool carries in one call;" \
         "leave out bitsandbytes (QLoRA's tests then skip)" >&2
    exit 1
fi
