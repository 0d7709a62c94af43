"""`lockstep` and `python -m lockstep` (lockstep/__main__.py): the command line's imports (torch's
among them) run with the collector off, and what they made is frozen, so later collections skip it."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

# each collection in `lockstep --help`: (when, frozen objects), when "before" torch's import, "during"
# the command line's imports (torch loaded, lockstep.cli not yet done) or "after"; the command started
# as `python -m` starts it, or as pip's console script does
PROBE = textwrap.dedent("""
    import gc, runpy, sys
    out = sys.argv[1]
    seen = []
    def note(phase, info):
        if phase == "start":
            cli = sys.modules.get("lockstep.cli")
            when = "after" if hasattr(cli, "entry") else "during" if "torch" in sys.modules else "before"
            seen.append((when, gc.get_freeze_count()))
            with open(out, "w") as f:
                f.write(repr(seen))
    gc.callbacks.append(note)
    sys.argv = ["lockstep", "--help"]
    if START == "module":
        runpy.run_module("lockstep", run_name="__main__", alter_sys=True)
    else:
        from lockstep.__main__ import main  # pyproject.toml's [project.scripts]
        main()
""")


@pytest.mark.parametrize("start", ["module", "script"])
def test_the_commands_imports_run_without_collections_and_are_frozen(tmp_path, start):
    out = tmp_path / "collections"
    probe = f"START = {start!r}\n" + PROBE
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "usage: lockstep" in proc.stdout, proc.stderr[-2000:]
    seen = ast.literal_eval(out.read_text())
    assert "during" not in {when for when, _ in seen}, seen  # no collection while torch loads
    # building --help's parsers collects at least once
    after = [frozen for when, frozen in seen if when == "after"]
    assert after and all(frozen > 100_000 for frozen in after), seen  # torch's objects, frozen
