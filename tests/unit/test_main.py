"""`python -m lockstep` (lockstep/__main__.py): the command line's imports (torch's among them) run
with the collector off, and what they made is frozen, so later collections skip it."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

# each collection in `python -m lockstep --help`: (generation, the imports were done, frozen objects)
PROBE = textwrap.dedent("""
    import gc, runpy, sys
    out = sys.argv[1]
    seen = []
    def note(phase, info):
        if phase == "start":
            done = "lockstep.cli" in sys.modules and "torch" in sys.modules
            seen.append((info["generation"], done, gc.get_freeze_count()))
            with open(out, "w") as f:
                f.write(repr(seen))
    gc.callbacks.append(note)
    sys.argv = ["lockstep", "--help"]
    runpy.run_module("lockstep", run_name="__main__", alter_sys=True)
""")


def test_the_commands_imports_run_without_collections_and_are_frozen(tmp_path):
    out = tmp_path / "collections"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "usage: lockstep" in proc.stdout, proc.stderr[-2000:]
    seen = ast.literal_eval(out.read_text())  # building --help's parsers collects at least once
    assert seen and all(done for _, done, _ in seen), seen  # none while torch and lockstep loaded
    assert all(frozen > 100_000 for _, _, frozen in seen), seen  # torch's objects, frozen
