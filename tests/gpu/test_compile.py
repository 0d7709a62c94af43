"""`--compile` (train.compile: the model compiled in place before DDP) against eager on CUDA (issue
23, item 2f): the same losses within a bf16 tolerance; both speeds recorded (JUnit properties), not
asserted.
"""

from __future__ import annotations

import json

from .runs import checkpoint_dir, losses, metrics, train

MODEL = "--hidden-size 128 --attention-heads 4 --layers 2 --max-seq-length 128"
RUN = "--global-batch-size 16 --max-steps 40 --log-interval 1 --learning-rate 3e-3 --warmup-steps 5"
FLAGS = [*MODEL.split(), *RUN.split(), "--mixed-precision", "bf16", "--set", "data.eval_fraction=0"]


def test_compiled_model_trains_to_the_eager_losses(tmp_path, corpus, token_cache, record_property):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train(eager, corpus, token_cache, *FLAGS)
    train(compiled, corpus, token_cache, *FLAGS, "--compile", timeout=600)
    for run, flag in ((eager, False), (compiled, True)):
        state = json.loads((checkpoint_dir(run) / "state.json").read_text())
        assert state["config"]["train"]["compile"] is flag
    a, b = losses(eager), losses(compiled)
    assert len(a) == len(b) == 40
    # bf16 autocast: inductor fuses the elementwise work between matmuls and rounds where eager
    # does not (or the other way round: a bias add split from its matmul), each rounding a step of
    # 2**-8 = 0.4% on one value. On equal weights the first loss agrees to 0.5%; after that the
    # updates differ by those roundings and the curves stay within 2%, the gap bf16 and fp32 runs
    # show (0.6% after 100 steps in test_train_cuda). The fp32 pair agreed to under 5e-6 at every
    # step on the CPU: the tolerance is bf16's, not compile's.
    assert abs(a[0] - b[0]) <= 0.005 * a[0], (a[0], b[0])
    assert max(abs(x - y) / x for x, y in zip(a, b)) <= 0.02, list(zip(a, b))
    assert b[-1] < b[0] - 1.0, b  # it learned (~5.5 at first)
    # tokens/s past the first 10 steps (the compiled run's first step holds the compilation)
    for name, run in (("eager", eager), ("compiled", compiled)):
        rows = metrics(run)[10:]
        tokens_per_s = sum(r["tokens_per_s"] for r in rows) / len(rows)
        record_property(f"{name}_tokens_per_s", round(tokens_per_s))
