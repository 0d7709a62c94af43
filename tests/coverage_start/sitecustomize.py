"""Run by every interpreter the suite starts, its pytest workers included (tests/conftest.py puts this
folder on PYTHONPATH while coverage measures): other packages' imports, torch.compile's compiler,
the dispatch modes lockstep.plan's simulation runs under, and the training step's optimizer,
clipping, FSDP2 and DDP hooks run without coverage's tracer (UNTRACED); and a forked process restarts
coverage once and saves once (_patch_coverage_once).

coverage.py records lockstep/ only, but on Python 3.11 its tracer is called at every function call
of every module while it runs, and an import runs thousands: `import torch, torch._dynamo` took
3.14 s traced, 2.64 s with this hook, 2.40 s without coverage; transformers, matplotlib, tensorboard
and peft after it 2.89 s, 2.35 s, 2.39 s (one interpreter each, Xeon with AVX-512, 26 Nov 2026).

An `import` of a module outside lockstep that is not loaded yet switches this thread's tracer off
for the import and on again after it (sys.settrace(None), then the tracer's own start(): other
threads keep theirs, unlike coverage's pause(), which stops every thread's). No line of lockstep runs
meanwhile, unless that import imports lockstep, and then the tracer is on again for that import.
What coverage records is unchanged: the same lines and branches with and without the hook, from
one process importing torch, transformers and lockstep.cli.train.
"""

import builtins
import contextlib
import functools
import importlib.machinery
import importlib.util
import os
import posix
import sys
import threading
from pathlib import Path

_import = builtins.__import__
_paused = threading.local()  # .tracer: this thread's tracer while an import runs untraced


def _ours(name: str, globals: dict | None, level: int) -> bool:
    target = (globals or {}).get("__package__") or "" if level else name
    return target == "lockstep" or target.startswith("lockstep.")


def _loaded(name: str, fromlist) -> bool:
    module = sys.modules.get(name)
    return module is not None and all(f == "*" or f in vars(module) for f in fromlist or ())


def _active() -> bool:
    collector = sys.modules.get("coverage.collector")
    return collector is not None and bool(collector.Collector._collectors)  # not stopped meanwhile


def untraced_import(name, globals=None, locals=None, fromlist=(), level=0):
    """builtins.__import__, with this thread's tracer off while it imports another package."""
    tracer = getattr(_paused, "tracer", None)
    if _ours(name, globals, level):
        if tracer is None:
            return _import(name, globals, locals, fromlist, level)
        _paused.tracer = None  # lockstep imported by another package: traced
        tracer.start()
        try:
            return _import(name, globals, locals, fromlist, level)
        finally:
            sys.settrace(None)
            _paused.tracer = tracer
    if tracer is not None or level or _loaded(name, fromlist):
        return _import(name, globals, locals, fromlist, level)
    try:
        return _untraced(_import, name, globals, locals, fromlist, level)
    finally:
        _untrace_the_compiler()
        _untrace_calls()
        _patch_coverage_once()


def _untraced(fn, *args):
    """fn(*args) with this thread's coverage tracer off (on again after it, if coverage still runs)."""
    tracer = sys.gettrace()
    if tracer is None or not hasattr(tracer, "start"):  # no coverage here, or not its C tracer
        return fn(*args)
    sys.settrace(None)
    _paused.tracer = tracer
    try:
        return fn(*args)
    finally:
        _paused.tracer = None
        if _active():
            tracer.start()


def _untrace_the_compiler() -> None:
    """torch.compile's compiler (dynamo's _compile: tracing, AOT autograd, inductor's code) untraced,
    once it is imported. It runs torch's code only: it traces a model's forward symbolically and
    runs none of its lines (those a compiled model runs are in the graph it makes). A cold compile
    of tests/unit/train/test_setup.py's two steps took 54.6 CPU-s traced, 39.2 without coverage."""
    module = sys.modules.get("torch._dynamo.convert_frame")
    compile = getattr(module, "_compile", None)
    if compile is not None and not hasattr(compile, "untraced"):

        def untraced_compile(*args, **kwargs):
            if getattr(_paused, "tracer", None) is not None:
                return compile(*args, **kwargs)
            return _untraced(lambda: compile(*args, **kwargs))

        untraced_compile.untraced = compile
        module._compile = untraced_compile


# Calls into another package that run no line of lockstep, made untraced once their modules are
# imported: (module, class or "" for a module's function, attribute).
UNTRACED = (
    # the dispatch modes lockstep.plan runs a whole training step under: every op of the step goes
    # through them (fake tensors' and the memory trackers' Python, ~20,000 ops for a tiny GPT's
    # step); the only lines of lockstep that run inside one are lockstep.plan.trackers' peak update
    # (4 lines, left unrecorded; tests/unit/plan/test_trackers.py checks the peak they keep against
    # torch's own tracker); tests/unit/plan and tests/unit/cli/test_plan.py took 133 CPU-s with
    # coverage and 74 without before this
    ("torch._subclasses.fake_tensor", "FakeTensorMode", "__torch_dispatch__"),
    ("torch.distributed._tools.mem_tracker", "MemTracker", "__torch_dispatch__"),
    ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker", "__torch_dispatch__"),
    # every training step of every rank: the optimizer (AdamW's step is Adam's, wrapped here before
    # torch's step hooks wrap it at the first optimizer), the gradients' norm and clipping, FSDP2's
    # module hooks, DDP's work before and after the model's forward (which stays traced);
    # tests/unit/test_coverage_start.py's one training step; a 2-rank `lockstep train` of 150 steps
    # 11.2 -> 10.6 CPU-s under DDP (10.5 -> 10.0 more with DDP's), 18.8 -> 16.1 under FSDP, the same
    # lines and branches recorded
    ("torch.optim.adam", "Adam", "step"),
    ("torch.optim.optimizer", "Optimizer", "zero_grad"),
    ("torch.nn.utils", "", "get_total_norm"),
    ("torch.nn.utils", "", "clip_grads_with_norm_"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", "_pre_forward"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", "_post_forward"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", "_pre_backward"),
    (
        "torch.distributed.fsdp._fully_shard._fsdp_state",
        "FSDPState",
        "_root_post_backward_final_callback",
    ),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "_pre_forward"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "_post_forward"),
    # FSDP2's work after a parameter group's backward (reduce-scatter of its gradients)
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup", "post_backward"),
    # a sharded checkpoint's state dict gathered and set, its host copy made, and DCP's save (in
    # DCP's own thread for a background save): torch's writer and planner, no line of lockstep;
    # not DCP's load, which reads through lockstep's SafeReader and SafeLoadPlanner
    ("torch.distributed.checkpoint.state_dict", "", "get_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "", "get_optimizer_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "", "get_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "", "set_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "", "set_optimizer_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "", "set_state_dict"),
    ("torch.distributed._state_dict_utils", "", "_copy_state_dict"),
    ("torch.distributed._state_dict_utils", "", "_create_cpu_state_dict"),
    ("torch.distributed.checkpoint.state_dict_saver", "", "save"),
    ("torch.distributed.checkpoint", "", "save"),
    # the end of every run: loss.png and step_times.png drawn
    ("matplotlib.figure", "Figure", "savefig"),
    ("matplotlib.figure", "Figure", "tight_layout"),
)


def _untrace_calls() -> None:
    """The calls in UNTRACED run with this thread's tracer off, once their modules are imported."""
    for module_name, owner_name, attr in UNTRACED:
        module = sys.modules.get(module_name)
        owner = getattr(module, owner_name, None) if owner_name else module
        fn = vars(owner).get(attr) if owner is not None else None
        if fn is None or hasattr(fn, "untraced"):
            continue

        @functools.wraps(fn)
        def untraced_call(*args, __fn=fn, **kwargs):
            if getattr(_paused, "tracer", None) is not None:
                return __fn(*args, **kwargs)
            return _untraced(lambda: __fn(*args, **kwargs))

        untraced_call.untraced = fn
        setattr(owner, attr, untraced_call)


# coverage 7.17's patch=fork registers one more at-fork handler every time coverage starts, and a
# forked child's restart is a start: a process forked d times over (a rank of `lockstep launch`: the
# forkserver's child, the launcher's warm server, its fork) restarted coverage 2**(d-1) times, each
# restart reading its configuration and the whole call stack's source (the collector's debug note),
# and each wrapped os._exit once more, so the process's end saved every ancestor's data again.
def _patch_coverage_once() -> None:
    """One at-fork handler a process, and os._exit and os.execv(e) wrapped once: they save the
    coverage that runs when they are called (the fork's restart, not the parent's stopped one)."""
    control, patch = sys.modules.get("coverage.control"), sys.modules.get("coverage.patch")
    covs = getattr(getattr(control, "Coverage", None), "_instances", None)
    # covs: none while coverage.control is still importing (coverage.patch is whole by then)
    if covs is None or hasattr(patch._patch_fork, "once"):
        return
    register = patch._patch_fork
    watched = any("fork" in cov.config.patch for cov in covs)  # started before this file ran

    def register_once(debug) -> None:  # a forked child inherits its parent's handler
        nonlocal watched
        if not watched:
            watched = True
            register(debug)

    def saving(real, env: bool):
        def call(*args, **kwargs):
            for cov in list(covs):  # started and not stopped: a fork's restart stops the parent's
                with contextlib.suppress(Exception):
                    cov.save()
            if env and covs:  # execve's environment: the new program measures as this one did
                args[-1]["COVERAGE_PROCESS_CONFIG"] = covs[-1].config.serialize()
            return real(*args, **kwargs)

        return call

    register_once.once = True
    patch._patch_fork = register_once
    patch._patch__exit = lambda cov, debug: None
    patch._patch_execv = lambda cov, config, debug: None
    os._exit = saving(posix._exit, env=False)
    os.execv, os.execve = saving(posix.execv, env=False), saving(posix.execve, env=True)
    collector = sys.modules.get("coverage.collector")
    if collector is not None:
        collector.short_stack = lambda *args, **kwargs: ""  # only printed when a tracer misbehaves


def install() -> None:
    builtins.__import__ = untraced_import
    _patch_coverage_once()


def _chain() -> None:
    """The sitecustomize this one shadows (a distribution's), run as it would have been."""
    here = str(Path(__file__).resolve().parent)
    rest = [p for p in sys.path if p and str(Path(p).resolve()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


install()
_chain()
