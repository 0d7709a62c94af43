"""`--compile` (train.compile: the model compiled in place before DDP) against eager on CUDA (issue
23, item 2f): in fp32 the same losses at every step; in bf16 the same start and the same end. Both
speeds and the bf16 pair's largest per-step gap are recorded (JUnit properties), not asserted.
"""

from __future__ import annotations

import json

from .runs import checkpoint_dir, losses, metrics, train

MODEL = "--hidden-size 128 --attention-heads 4 --layers 2 --max-seq-length 128"
RUN = "--global-batch-size 16 --max-steps 40 --log-interval 1 --learning-rate 3e-3 --warmup-steps 5"
FLAGS = [*MODEL.split(), *RUN.split(), "--set", "data.eval_fraction=0"]


def eager_and_compiled(tmp_path, corpus, token_cache, precision: str) -> tuple[list, list]:
    """The per-step losses of an eager and a compiled run of the same 40 steps."""
    eager, compiled = tmp_path / f"eager-{precision}", tmp_path / f"compiled-{precision}"
    flags = [*FLAGS, "--mixed-precision", precision]
    train(eager, corpus, token_cache, *flags)
    train(compiled, corpus, token_cache, *flags, "--compile", timeout=600)
    for run, flag in ((eager, False), (compiled, True)):
        state = json.loads((checkpoint_dir(run) / "state.json").read_text())
        assert state["config"]["train"]["compile"] is flag
    a, b = losses(eager), losses(compiled)
    assert len(a) == len(b) == 40
    return a, b


def test_compiled_model_trains_to_the_eager_losses_in_fp32(tmp_path, corpus, token_cache):
    # what compile itself may change: the order of fp32 sums inside fused kernels, ~1e-7 a value.
    # The CPU pair agreed to under 5e-6 at every step; 1e-3 leaves room for the GPU's reductions
    # and still fails on a compiled graph that computes something else (a dropped op, a stale
    # weight), which moves the loss by percents within a few steps.
    a, b = eager_and_compiled(tmp_path, corpus, token_cache, "no")
    assert max(abs(x - y) / x for x, y in zip(a, b)) <= 1e-3, list(zip(a, b))
    assert b[-1] < b[0] - 1.0, b  # it learned (~5.5 at first)


def test_compiled_model_trains_to_the_eager_losses_in_bf16(
    tmp_path, corpus, token_cache, record_property
):
    # bf16 autocast: inductor fuses the elementwise work between matmuls and rounds where eager
    # does not, each rounding a step of 2**-8 = 0.4% on one value. On equal weights the first loss
    # agrees to 0.5%; after that the two runs take different updates and single steps drift apart:
    # the largest gap of the 40 steps was 3.9% in one run and 0.95% in the next on an H200
    # (2026-11-26, BENCHMARKS.md), so steps are not compared one by one here. The end is: the mean
    # of the last 10 losses within 2%, the bound test_train_cuda puts on bf16 against fp32.
    a, b = eager_and_compiled(tmp_path, corpus, token_cache, "bf16")
    assert abs(a[0] - b[0]) <= 0.005 * a[0], (a[0], b[0])
    end_a, end_b = sum(a[-10:]) / 10, sum(b[-10:]) / 10
    assert abs(end_a - end_b) <= 0.02 * end_a, (end_a, end_b, list(zip(a, b)))
    assert b[-1] < b[0] - 1.0, b  # it learned (~5.5 at first)
    record_property("largest_step_gap", round(max(abs(x - y) / x for x, y in zip(a, b)), 4))
    # tokens/s past the first 10 steps (the compiled run's first step holds the compilation)
    for name in ("eager", "compiled"):
        rows = metrics(tmp_path / f"{name}-bf16")[10:]
        tokens_per_s = sum(r["tokens_per_s"] for r in rows) / len(rows)
        record_property(f"{name}_tokens_per_s", round(tokens_per_s))
