"""No import circles in `fsdp_utils` and `monitoring`, not even inside a function.

import-linter's layers contract (`make lint`) keeps the stages in order, but it cannot see a
circle between two modules of one layer (two modules of `slurm/`, say). This test builds the
import graph from the source itself: every `import` and `from ... import` anywhere in a module
(at module level, inside functions, under `if TYPE_CHECKING:`), with `from pkg import submodule`
resolved to the submodule. A circle fails the test, named with the line of each import in it.

`make lint` runs this module too (`python -m pytest tests/test_imports.py`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fsdp_utils", "monitoring")


@dataclass(frozen=True)
class Import:
    target: str
    file: Path
    line: int

    def where(self, root: Path) -> str:
        return f"{self.file.relative_to(root)}:{self.line}"


def module_names(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of the packages under `root`: dotted name -> file (a package is its
    `__init__.py`)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The imports of one module that name a module in `modules` (others are left out)."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, is_package)
            # `from pkg import sub` imports the module pkg.sub; `from pkg import name`, pkg.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # `import a.b.c` of a name that is not a module (a typo caught elsewhere): its
            # nearest enclosing module.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append(Import(target, path, node.lineno))
    return found


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    # `from . import x` in a.b.c means a.b; in the package a.b itself (its __init__), a.b too.
    parts = importer.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def import_graph(root: Path = REPO_ROOT) -> dict[str, list[Import]]:
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, list[Import]]) -> list[list[str]]:
    """The groups of modules that reach each other (Tarjan's algorithm, iterative), each with
    more than one module, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted({i.target for i in graph[start]})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted({i.target for i in graph[child]}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def shortest_cycle(graph: dict[str, list[Import]], group: list[str]) -> list[Import]:
    """One shortest circle through the first module of `group`, as the imports that make it."""
    members, start = set(group), group[0]
    came_from: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target not in members or edge.target in came_from:
                    continue
                came_from[edge.target] = Import(node, edge.file, edge.line)
                if edge.target == start:
                    following.clear()
                    break
                following.append(edge.target)
            if start in came_from:
                break
        frontier = following
    # Walk back from the start to itself; each step's `target` holds the importer.
    cycle, node = [], start
    while True:
        step = came_from[node]
        cycle.append(Import(node, step.file, step.line))
        node = step.target
        if node == start:
            return cycle[::-1]


def describe_cycles(graph: dict[str, list[Import]], root: Path = REPO_ROOT) -> list[str]:
    """One paragraph per circle: the modules involved, and one shortest circle with the line
    of each import in it."""
    paragraphs = []
    for group in strongly_connected(graph):
        steps = "\n".join(
            f"    {step.where(root)} imports {step.target}" for step in shortest_cycle(graph, group)
        )
        paragraphs.append(f"  {' <-> '.join(group)}\n{steps}")
    return paragraphs


# --- the test ----------------------------------------------------------------------------------


def test_no_import_circles():
    cycles = describe_cycles(import_graph())
    assert not cycles, (
        "Import circles (move what both sides need into a module of its own, or pass it in):\n"
        + "\n".join(cycles)
    )


# --- the checker itself: it must see every kind of import ----------------------------------------


def _package(root: Path, files: dict[str, str]) -> dict[str, list[Import]]:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    modules = module_names(root, ["pkg"])
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


@pytest.mark.parametrize(
    "back",
    [
        "import pkg.a\n",
        "def f():\n    from pkg import a\n",  # a function-level import of a submodule
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        "from . import a\n",
        "from .a import A\n",
        "class C:\n    def m(self):\n        import pkg.a as alias\n",
    ],
)
def test_every_kind_of_import_closes_the_circle(tmp_path, back):
    graph = _package(
        tmp_path,
        {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import B\nA = 1\n", "pkg/b.py": back},
    )
    assert strongly_connected(graph) == [["pkg.a", "pkg.b"]]
    cycle = shortest_cycle(graph, ["pkg.a", "pkg.b"])
    assert [(step.target, step.file.name, step.line) for step in cycle] == [
        ("pkg.b", "a.py", 1),
        ("pkg.a", "b.py", back.count("\n")),
    ]


def test_a_package_that_gathers_its_submodules_is_no_circle_until_one_imports_it(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.sub.x import X\n",
        "pkg/sub/__init__.py": "from .x import X\n",
        "pkg/sub/x.py": "from pkg.y import Y\nX = 1\n",
        "pkg/y.py": "import os\nY = 2\n",
    }
    assert strongly_connected(_package(tmp_path, files)) == []
    # A name taken from a package is an import of its __init__, which imports pkg.y back.
    files["pkg/y.py"] = "from pkg import X\nY = 2\n"
    assert strongly_connected(_package(tmp_path, files)) == [["pkg", "pkg.sub.x", "pkg.y"]]


def test_a_longer_circle_is_named_in_order(tmp_path):
    graph = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import pkg.b\n",
            "pkg/b.py": "import os\nimport pkg.c\n",
            "pkg/c.py": "def late():\n    import pkg.a\n",
            "pkg/d.py": "import pkg.a\n",  # reaches the circle, is not in it
        },
    )
    (text,) = describe_cycles(graph, tmp_path)
    assert text == (
        "  pkg.a <-> pkg.b <-> pkg.c\n"
        "    pkg/a.py:1 imports pkg.b\n"
        "    pkg/b.py:2 imports pkg.c\n"
        "    pkg/c.py:2 imports pkg.a"
    )


# --- what a command imports before it parses its flags ----------------------------------------

HEAVY = ("torch", "transformers", "datasets", "peft", "torchao", "lm_eval", "matplotlib")


@pytest.mark.parametrize(
    "command",
    [
        ["chess_finetune.py", "--help"],
        ["chess_finetune.py", "--print_config", "--model", "m"],
        ["download_models.py", "--help"],
        ["monitoring/gpu_report.py", "--help"],
    ],
)
def test_help_imports_nothing_heavy(command):
    """`--help` answers in about a second on a busy login node: nothing that imports torch or
    transformers (9 s of torch.distributed's tensor machinery, measured there under load,
    before chess_finetune.py's flags were read) comes before the flags are parsed."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-X", "importtime", *command],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert not {name for name in imported if name.split(".")[0] in HEAVY}, command
