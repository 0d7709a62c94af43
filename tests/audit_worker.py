"""Run `lockstep` under torchrun while recording every file-system write this rank makes (Python audit hooks).

Used by test_train_dist to show that only global rank 0 writes checkpoint files.
"""

import json
import os
import sys

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
writes: list[tuple[str, str]] = []


def hook(event: str, args: tuple) -> None:
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            mode is None and flags & WRITE_FLAGS
        ):
            writes.append((event, os.fsdecode(args[0])))
    elif event in (
        "os.rename",
        "os.replace",
        "os.mkdir",
        "os.remove",
        "os.rmdir",
        "shutil.rmtree",
        "os.truncate",
    ):
        writes.append((event, os.fsdecode(args[0])))


if __name__ == "__main__":
    out = sys.argv[1]
    sys.argv = ["lockstep", *sys.argv[2:]]
    sys.addaudithook(hook)
    from lockstep.cli import main
    from lockstep.runtime.process_end import exit_process

    code = main()
    with open(f"{out}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump([w for w in writes if not w[1].startswith(out)], f)
    exit_process(code)
