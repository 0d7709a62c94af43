"""The package's shape, measured from its own source: the rules a newcomer relies on to find their way.

- a folder per stage of the data flow, and imports run one way only: a module imports its own stage or
  earlier ones (STAGES), never a later one, and no files import each other in a circle;
- checkpoint/ is a library: it knows no config, model, data, parallel layout or trainer;
- short modules and functions, counted as `ruff format` writes them; few files at the top of the package;
- tests mirror the package: lockstep/<folder>/<module>.py has tests/unit/<folder>/test_<module>.py;
- train/ passes no call more than 5 positional arguments; the code cites documents of the repository.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lockstep"
TESTS = Path(__file__).resolve().parent

# the data flow, first to last; a module may import from its own stage and the ones before it
STAGES = [
    {"errors", "__init__"},  # the package face: its version
    {"config", "user_code", "run_dir"},
    {"runtime", "collectives", "rng"},
    {"models"},
    {"parallel"},
    {"data"},
    {"checkpoint", "metrics", "rank_logs", "peak_flops", "watchdog", "optim"},
    {"train"},
    {"tools", "plan"},
    {"launch", "doctor"},
    {"cli", "__main__"},
]
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TOP_FILES = 400, 100, 12


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that this file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("lockstep")
        ):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lockstep")}
    return {m for m in found if m in known}


def stage(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, names in enumerate(STAGES):
        if top in names:
            return i
    raise AssertionError(
        f"{module}: lockstep/{top} is in no stage of STAGES; add it where it belongs in the data flow"
    )


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_imports_run_down_the_data_flow(graph):
    upward = [
        f"{a} (stage {stage(a)}) imports {b} (stage {stage(b)})"
        for a, deps in graph.items()
        for b in deps
        if stage(b) > stage(a)
    ]
    assert upward == []


def test_no_import_circles(graph):
    # Tarjan's strongly connected components: any component of two or more modules is a circle
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_checkpoint_is_a_library(graph):
    allowed = (
        "lockstep.checkpoint",
        "lockstep.errors",
        "lockstep.collectives",
        "lockstep.runtime",
        "lockstep.run_dir",
    )
    reaching = [
        f"{a} imports {b}"
        for a, deps in graph.items()
        if a.startswith("lockstep.checkpoint")
        for b in deps
        if not b.startswith(allowed)
    ]
    assert reaching == []


def test_short_modules_and_functions():
    long_modules, long_functions = [], []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name}: {length} lines")
    assert long_modules == [] and long_functions == []


def test_few_files_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_FILES, top


def test_every_module_has_a_unit_test_file():
    missing = []
    for name, path in modules().items():
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(PACKAGE)
        expected = TESTS / rel.parent / f"test_{rel.stem}.py"
        if not expected.exists():
            missing.append(str(expected.relative_to(TESTS.parent)))
    assert missing == []


LOGGING_CALLS = {
    "debug",
    "info",
    "warning",
    "error",
    "exception",
    "critical",
    "log",
}  # %-style: data, not an API


def test_no_call_in_train_passes_more_than_5_positional_arguments():
    """train/ talks through components and keywords: a call with more positional arguments is a bag in disguise."""
    crowded = []
    for path in sorted((PACKAGE / "train").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or len(node.args) <= 5:
                continue
            if isinstance(node.func, ast.Attribute) and node.func.attr in LOGGING_CALLS:
                continue
            crowded.append(
                f"{path.name}:{node.lineno} {ast.unparse(node.func)}: {len(node.args)} positional"
            )
    assert crowded == []


def test_the_code_cites_documents_of_the_repository_and_their_sections():
    """A docstring's `docs/NAME.md, "Section"` names a file in the repository and a heading in it."""
    import re

    root, cited = PACKAGE.parent, []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        assert "DESIGN.md" not in text, f"{path}: cites DESIGN.md, which is not in the repository"
        cited += [
            (path, m.group(1), m.group(3))
            for m in re.finditer(r"(docs/[\w-]+\.md)(, \"([^\"]+)\")?", text)
        ]
    assert len(cited) >= 5
    for path, doc, section in cited:
        assert (root / doc).is_file(), f"{path}: cites {doc}, which does not exist"
        headings = [
            line.lstrip("#").strip()
            for line in (root / doc).read_text().splitlines()
            if line.startswith("#")
        ]
        body = (root / doc).read_text()
        assert section is None or section in headings or f"**{section}.**" in body, (
            path,
            doc,
            section,
        )


def test_modules_are_counted_as_ruff_format_writes_them():
    """The sizes above are the formatted sizes: every module is as `ruff format` (100 columns, pyproject.toml)
    writes it, and `ruff check` (pyflakes, pycodestyle, import order) finds nothing."""
    # the test extras' pinned ruff, beside this interpreter
    ruff = Path(sys.executable).with_name("ruff")
    assert ruff.is_file(), f"{ruff}: install the test extras (pip install -e '.[test]')"
    for command in (["format", "--check", "--quiet"], ["check", "--quiet"]):
        cmd = [str(ruff), *command, str(PACKAGE)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=PACKAGE.parent)
        assert proc.returncode == 0, f"ruff {' '.join(command)}:\n{proc.stdout}{proc.stderr}"
