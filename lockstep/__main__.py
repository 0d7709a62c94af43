"""`lockstep` and `python -m lockstep`: the command line (lockstep/cli).

Importing it imports torch: some 300k objects that live as long as the process. Left to the
collector, each full collection the imports set off walks all of them again (0.6 s of a command's
start on this project's 2-core machines); imported with the collector off and then frozen
(Python's gc docs, gc.freeze), later collections skip them.
"""

import gc
from typing import NoReturn


def main() -> NoReturn:
    gc.disable()
    from lockstep.cli import entry

    gc.freeze()
    gc.enable()
    entry()


if __name__ == "__main__":
    main()
