"""Lightning Trainer names for `lockstep train` (and slurm, check, parity), as aliases.

A user of Lightning's Trainer or LightningCLI types `--devices 4 --precision bf16-mixed
--max_epochs 3` (or LightningCLI's `--trainer.devices 4`). Each name lockstep has an equivalent
for means what it means in Lightning and sets the config keys its --help names (`--print-config`
shows the result); the others stop the command before training, saying why and the lockstep way.
Values stay strings: the config layer coerces them and names the rule a bad one breaks.

Process counts follow Lightning: --devices is processes on this node, --num_nodes the nodes.
Outside a launcher `lockstep train` starts the processes itself, on this node only; under
torchrun or srun the launcher started them, and the two flags must agree with what it started.

Precedence is hf_args's: a key that a Lightning name and another flag both set must get one
value, or the command stops naming both; keys a name only implies give way to any flag.
"""

from __future__ import annotations

import argparse

from lockstep.cli.hf_args import Setting, merge_settings
from lockstep.cli.hf_refused import REFUSED as HF_REFUSED
from lockstep.errors import ConfigError
from lockstep.runtime import LaunchEnv

GROUP = "Lightning Trainer names"
DEST = "pl:"  # argparse dest prefix: no dot, so train's dotted-key overrides never pick these up
# Lightning name -> (metavar, what it does here); each also spelled --trainer.NAME (LightningCLI)
NAMES = {
    "devices": (
        "N|auto",
        "processes on this node (Lightning's meaning); outside a launcher starts N "
        "local workers (sets distributed.world_size), under torchrun / srun must equal "
        "the processes per node it started; auto or -1: one per GPU",
    ),
    "num_nodes": (
        "N",
        "nodes; above 1 only under a launcher (torchrun --nnodes, `lockstep slurm "
        "--nodes N`, `lockstep k8s`), whose node count it must equal",
    ),
    "accelerator": ("{auto,cpu,gpu,cuda}", "sets distributed.device (gpu and cuda: cuda)"),
    "strategy": (
        "NAME",
        "auto, ddp, fsdp, ddp_find_unused_parameters_true / _false (sets "
        "parallel.data_parallel and parallel.find_unused_parameters)",
    ),
    "precision": (
        "P",
        "32 / 32-true: no autocast; bf16-mixed / bf16: bf16 autocast; 16-mixed / 16: fp16 "
        "autocast with a GradScaler (sets train.mixed_precision); true half precision "
        "and 64 are refused",
    ),
    "accumulate_grad_batches": ("N", "micro-batches per optimizer step (sets train.grad_accum)"),
    "max_epochs": (
        "E",
        "passes over the data (sets train.epochs, and train.max_steps=none unless "
        "--max_steps is given: training stops at whichever comes first, as in Lightning)",
    ),
    "max_steps": (
        "N",
        "optimizer steps (sets train.max_steps); -1: no step limit, train --max_epochs",
    ),
    "gradient_clip_val": (
        "NORM",
        "clip the global gradient norm (sets optim.gradient_clip_norm; 0 = no clipping)",
    ),
    "gradient_clip_algorithm": ("norm", "only norm, lockstep's clipping"),
    "log_every_n_steps": ("N", "log metrics every N optimizer steps (sets train.log_interval)"),
    "default_root_dir": (
        "DIR",
        "run directory: checkpoints, logs, metrics (sets checkpoint.output_dir)",
    ),
    "val_check_interval": (
        "N",
        "evaluate every N training batches: train.eval_interval = N / "
        "--accumulate_grad_batches (lockstep counts optimizer steps); a fraction "
        "of an epoch is refused",
    ),
    "seed_everything": (
        "N",
        "LightningCLI's seed: init, data order and every rank's RNG (sets train.seed)",
    ),
}
# Lightning names refused: each with the reason and the lockstep way
REFUSED = {
    "limit_train_batches": "lockstep trains on whole passes over the data; to stop early pass "
    "--max_steps N (optimizer steps), to read less data --set data.max_files=N or data.max_bytes=N",
    "check_val_every_n_epoch": "lockstep evaluates every N optimizer steps, not per epoch; pass "
    "--val_check_interval N (training batches) or --eval-interval N (steps)",
}
_STRATEGIES = {"ddp": "ddp", "ddp_spawn": "ddp", "ddp_fork": "ddp", "fsdp": "fsdp"}
_PRECISIONS = {
    "32": "no",
    "32-true": "no",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "16": "fp16",
    "16-mixed": "fp16",
}


def add_lightning_arguments(p: argparse.ArgumentParser) -> None:
    """The Lightning names as an argument group of `p`; a spelling `p` already has stays its own
    (--max_steps is HF Trainer's, with the same meaning: -1 = no step limit)."""
    taken = {o for a in p._actions for o in a.option_strings}
    g = p.add_argument_group(
        GROUP,
        (
            "Lightning Trainer flags, meaning what they mean in Lightning, also in LightningCLI's "
            "spelling (--trainer.devices); each sets the config keys named (see --print-config). "
            "--max_steps is the HF name above, with Lightning's meaning too. Refused before "
            "training, with the reason and the lockstep way: --limit_train_batches, "
            "--check_val_every_n_epoch, --strategy deepspeed, --precision bf16-true / 16-true / 64."
        ),
    )
    for name, (metavar, text) in NAMES.items():
        spellings = [s for s in (f"--{name}", f"--trainer.{name}") if s not in taken]
        if spellings:
            g.add_argument(*spellings, dest=DEST + name, metavar=metavar, help=text)
    for name in REFUSED:
        # hidden from --help and from "did you mean": named in the group's text instead
        g.add_argument(
            f"--{name}", f"--trainer.{name}", dest=DEST + name, nargs="*", help=argparse.SUPPRESS
        )


def merge_lightning_names(
    args: argparse.Namespace, out: dict[str, object], sources: dict[str, str], launch: LaunchEnv
) -> dict[str, object]:
    """`out` (dotted key -> value; `sources` names the flag of each) with the Lightning names in
    `args` added; raises ConfigError for a refused name or value, or a key given two values."""
    given = {
        k.removeprefix(DEST): v
        for k, v in vars(args).items()
        if k.startswith(DEST) and v is not None
    }
    if not given:
        return out
    return merge_settings(lightning_settings(given, launch, out), out, sources)


def lightning_settings(
    given: dict[str, object], launch: LaunchEnv, others: dict[str, object] | None = None
) -> list[tuple[str, Setting]]:
    """(the flag as given, a key it sets) for each Lightning name in `given` (name -> raw value);
    `launch` says what a launcher started, `others` what the other flags set (--max_steps)."""
    for name, raw in given.items():
        if name in REFUSED:
            received = " ".join([f"--{name}", *map(str, raw)])
            raise ConfigError(f"{received}: not supported: {REFUSED[name]}")
    out = []
    for name, raw in given.items():
        label = f"--{name} {raw}"
        out += [(label, s) for s in _settings(name, str(raw).strip(), given, launch, others or {})]
    return out


def _settings(
    name: str, raw: str, given: dict[str, object], launch: LaunchEnv, others: dict[str, object]
) -> list[Setting]:
    flag = f"--{name} {raw}"
    match name:
        case "devices" | "num_nodes":
            return _process_counts(name, raw, given, launch)
        case "accelerator":
            devices = {"auto": "auto", "cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}
            if raw not in devices:
                raise ConfigError(
                    f"{flag}: lockstep trains on CUDA GPUs or on CPU; pass --accelerator "
                    "gpu, cpu or auto"
                )
            return [Setting("distributed.device", devices[raw])]
        case "strategy":
            return _strategy(flag, raw)
        case "precision":
            return _precision(flag, raw)
        case "accumulate_grad_batches":
            return [Setting("train.grad_accum", raw)]
        case "max_epochs":
            if raw == "-1":  # Lightning: no epoch limit
                steps = given.get("max_steps", others.get("train.max_steps"))
                if _int(steps, "max_steps") > 0:
                    return [Setting("train.epochs", None, "flags")]
                raise ConfigError(
                    f"{flag} trains without end in Lightning unless --max_steps stops it; "
                    "lockstep needs an end: pass --max_steps N, or --max_epochs E"
                )
            return [Setting("train.epochs", raw), Setting("train.max_steps", None, "flags")]
        case "max_steps":  # --trainer.max_steps; the bare --max_steps is hf_args's, same meaning
            steps = _int(raw, name)
            if steps == 0 or steps < -1:
                raise ConfigError(
                    f"{flag}: must be a positive number of optimizer steps, or -1 "
                    "(no step limit: train --max_epochs); pass e.g. --max_steps 1000"
                )
            return (
                [Setting("train.max_steps", raw)]
                if steps > 0
                else [Setting("train.max_steps", None, "flags")]
            )
        case "gradient_clip_val":
            return [Setting("optim.gradient_clip_norm", raw)]
        case "gradient_clip_algorithm":
            if raw != "norm":
                raise ConfigError(
                    f"{flag}: lockstep clips the global gradient norm "
                    "(optim.gradient_clip_norm), not each value; pass "
                    "--gradient_clip_algorithm norm or drop it"
                )
            return []
        case "log_every_n_steps":
            return [Setting("train.log_interval", raw)]
        case "default_root_dir":
            return [Setting("checkpoint.output_dir", raw)]
        case "val_check_interval":
            return _val_check_interval(
                flag, raw, given.get("accumulate_grad_batches", others.get("train.grad_accum"))
            )
        case "seed_everything":
            return [Setting("train.seed", raw)]
    raise AssertionError(f"no rule for Lightning name {name!r}")


def _process_counts(
    name: str, raw: str, given: dict[str, object], launch: LaunchEnv
) -> list[Setting]:
    """--devices and --num_nodes: a local world size outside a launcher, a check under one."""
    flag = f"--{name} {raw}"
    under = launch.launcher in ("torchrun", "slurm")
    launcher = "torchrun" if launch.launcher == "torchrun" else "srun"
    if name == "num_nodes":
        nodes, launched = _int(raw, name), launch.world_size // launch.local_world_size
        if nodes < 1:
            raise ConfigError(
                f"{flag}: must be a positive number of nodes; pass e.g. --num_nodes 2"
            )
        if under and nodes != launched:
            raise ConfigError(
                f"{flag} but {launcher} started {launch.world_size} processes, "
                f"{launch.local_world_size} per node: {launched} node(s); make --num_nodes equal "
                "the launcher's node count, or drop it"
            )
        if not under and nodes > 1:
            raise ConfigError(
                f"{flag}: `lockstep train` outside a launcher starts processes on this node only; "
                f"for {nodes} nodes run `lockstep slurm --nodes {nodes}` (SLURM), `lockstep k8s` "
                f"(Kubernetes), or `torchrun --nnodes {nodes} ... -m lockstep train` on every node"
            )
        return []
    if raw in ("auto", "-1"):  # Lightning: every GPU on the node (one process on CPU)
        return []
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(
            f"{flag}: lockstep takes a number of processes per node (or auto / -1: one per GPU), "
            "not a list of device indices; pick GPUs with CUDA_VISIBLE_DEVICES=0,1 and pass "
            "--devices 2"
        )
    devices = int(raw)
    if under:
        if devices != launch.local_world_size:
            started = (
                f"LOCAL_WORLD_SIZE={launch.local_world_size} processes on this node (its "
                "--nproc_per_node)"
                if launcher == "torchrun"
                else f"{launch.local_world_size} tasks on this node (--ntasks-per-node)"
            )
            raise ConfigError(
                f"{flag} but {launcher} started {started}; make them agree, or drop --devices"
            )
        return []
    return [Setting("distributed.world_size", str(devices))]


def _strategy(flag: str, raw: str) -> list[Setting]:
    if raw.startswith("deepspeed"):
        raise ConfigError(f"{flag}: not supported: {HF_REFUSED['deepspeed']}")
    if raw == "auto":
        return []
    if raw in _STRATEGIES:
        return [Setting("parallel.data_parallel", _STRATEGIES[raw])]
    unused = raw.removeprefix("ddp_find_unused_parameters_")
    if raw.startswith("ddp_find_unused_parameters_") and unused in ("true", "false"):
        return [
            Setting("parallel.data_parallel", "ddp"),
            Setting("parallel.find_unused_parameters", unused),
        ]
    raise ConfigError(
        f"{flag}: lockstep runs DDP or FSDP2 (parallel.data_parallel); pass --strategy "
        "ddp, fsdp, ddp_find_unused_parameters_true or auto"
    )


def _precision(flag: str, raw: str) -> list[Setting]:
    if raw in _PRECISIONS:
        return [Setting("train.mixed_precision", _PRECISIONS[raw])]
    if raw in ("bf16-true", "16-true"):
        dtype = "bfloat16" if raw.startswith("bf16") else "float16"
        raise ConfigError(
            f"{flag}: not supported: lockstep keeps fp32 master weights and autocasts the forward "
            f"(pass --precision {raw.replace('true', 'mixed')}); to load a Hugging Face model's "
            f"weights in {dtype} instead, pass --set model.dtype={dtype}"
        )
    if raw in ("64", "64-true"):
        raise ConfigError(
            f"{flag}: not supported: lockstep trains in float32 at most; pass --precision 32-true"
        )
    raise ConfigError(
        f"{flag}: lockstep's precisions are 32-true (32), bf16-mixed (bf16) and "
        "16-mixed (16); pass one of those"
    )


def _val_check_interval(flag: str, raw: str, accumulation: object) -> list[Setting]:
    if not raw.isdigit():  # Lightning: a float is a fraction of the training epoch
        raise ConfigError(
            f"{flag}: lockstep evaluates every N optimizer steps, not at a fraction of an epoch; "
            "pass --val_check_interval N (training batches) or --eval-interval N (optimizer steps)"
        )
    batches, accum = int(raw), _int(accumulation or "1", "accumulate_grad_batches")
    if batches % accum:
        raise ConfigError(
            f"{flag}: counts training batches, and lockstep evaluates after an optimizer step "
            f"(every {accum} batches with --accumulate_grad_batches {accum}); pass a multiple of "
            f"{accum}, or --eval-interval N in optimizer steps"
        )
    return [Setting("train.eval_interval", str(batches // accum))]


def _int(raw: object, name: str) -> int:
    """A Lightning integer flag's value; -1 (its 'no limit') when not given."""
    if raw is None:
        return -1
    try:
        return int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"--{name} {raw}: must be an integer; pass e.g. --{name} 2") from None
