#!/usr/bin/env bash
# The GPU tier in one command: `pytest -m gpu`, then GPT-2 124M lockstep vs the raw loop, then the
# GPU section of BENCHMARKS.md. The logic is in bench/gpu/tier.py.
#
#   bash bench/gpu/run.sh [--plan] [--wheels DIR] [--out DIR] [--part tests|bench|all]
#
#   --plan          print the steps and their estimated minutes; run nothing (also without CUDA)
#   --wheels DIR    first install DIR/*.whl (bench/gpu/fetch_wheels.sh makes DIR) into
#                   /tmp/lockstep-site, which goes first on PYTHONPATH
#   --out DIR       the results folder, at most 8 files (default gpu-results/)
#   --part P        tests, bench, or all (the default); each part alone ends within 10 minutes
#   --test-workers N  pytest-xdist workers for the tests (default 4; 1 runs them one at a time)
#
# Without CUDA it prints one line and exits 2. It runs the `python3` on PATH (LOCKSTEP_PYTHON=...
# for another) with the torch installed there, and never installs torch. Exit 0 when every part
# ran to its end and passed, 1 otherwise.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${LOCKSTEP_PYTHON:-python3}" "$here/tier.py" "$@"
