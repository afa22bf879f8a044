"""The shape a maintainer relies on, read from the source itself (no imports run):

- the import graph has no cycle, and points one way: stages -> pipeline phases -> shared modules -> serving;
  serving never imports torch or pipeline;
- stage mains stay thin and no function grows past one screen;
- every dvc.yaml stage depends on all the code it runs, so DVC reruns it on any change;
- an import inside a function says why (a measured start-up cost);
- the pinned lock satisfies the ranges pyproject.toml declares.
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from pipeline.training.fit import code_files
from tests.conftest import ROOT

PHASES = ("data", "training", "evaluation", "export", "registry")
# what each phase may import besides the shared modules and serving
PHASE_MAY_IMPORT = {
    "data": set(),
    "training": {"data"},
    "evaluation": {"data"},
    "export": {"data"},
    "registry": {"data", "export"},
}
ENTRY_MODULES = {
    "pipeline.cli",
    "pipeline.profiles",
    "pipeline.sweep",
}  # command-line entries beside stages/: they may import phases
MAX_FUNCTION_LINES = 80
MAX_STAGE_MAIN_LINES = 30


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(name: str) -> Path | None:
    base = ROOT / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def source_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported(path: Path, top_level_only: bool = False) -> set[str]:
    """The project modules (pipeline.*, serving.*) that ``path`` imports, anywhere in it or at its top."""
    nodes = tree(path).body if top_level_only else ast.walk(tree(path))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out |= {n for n in [node.module, *names] if module_file(n)}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if module_file(a.name)}
    return {m for m in out if m.split(".")[0] in ("pipeline", "serving")}


def all_imports(path: Path) -> set[str]:
    """Every top-level package ``path`` imports (third-party ones included)."""
    out = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
    return out


def closure(start: str) -> set[str]:
    """Every project module importing ``start`` runs (parent packages' __init__ included)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if module_file(".".join(parts[:i]))]
        todo += sorted(imported(module_file(name)))
    return seen


def layer(name: str) -> str:
    """serving | shared | a phase | entry | stage."""
    parts = name.split(".")
    if parts[0] == "serving":
        return "serving"
    if parts[0] == "stages" or name in ENTRY_MODULES:
        return "entry"
    if len(parts) > 1 and parts[1] in PHASES:
        return parts[1]
    return "shared"


def test_the_import_graph_has_no_cycle():
    graph = {module_name(p): imported(p) for p in source_files("pipeline", "serving")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:  # a package imported by name (pipeline.data): its __init__
                continue
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_imports_point_from_stages_to_phases_to_shared_modules_to_serving():
    wrong = []
    for path in source_files("pipeline", "serving"):
        name = module_name(path)
        mine = layer(name)
        for target in imported(path):
            theirs = layer(target)
            allowed = {
                "serving": {"serving"},
                "shared": {"shared", "serving"},
                "entry": {"entry", "shared", "serving", *PHASES},
            }.get(mine, {"shared", "serving", mine, *PHASE_MAY_IMPORT.get(mine, ())})
            if theirs not in allowed:
                wrong.append(f"{name} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_trainer_to_load_or_run_a_model():
    users = [
        module_name(p)
        for p in source_files("pipeline", "serving", "stages", "benchmarks")
        if any(t.startswith("pipeline.training") for t in imported(p)) and layer(module_name(p)) != "training"
    ]
    # the training-throughput benchmark times the train stage's own step loop
    assert users == ["benchmarks.train_throughput", "stages.train"], users


def test_serving_never_imports_torch_or_pipeline():
    for path in source_files("serving"):
        assert not all_imports(path) & {"torch", "pipeline", "timm", "torchvision"}, path


def function_lengths(path: Path):
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            yield node.name, node.end_lineno - start + 1


def test_no_function_is_longer_than_one_screen():
    long = [
        f"{p.relative_to(ROOT)}: {name} has {n} lines"
        for p in source_files("pipeline", "serving", "stages", "benchmarks", "scripts")
        for name, n in function_lengths(p)
        if n > MAX_FUNCTION_LINES
    ]
    assert not long, "\n".join(long)


def test_stage_mains_are_thin():
    for path in source_files("stages"):
        lengths = dict(function_lengths(path))
        assert lengths.get("main", 0) <= MAX_STAGE_MAIN_LINES, f"{path.name}: main has {lengths['main']} lines"


def test_an_import_inside_a_function_says_why():
    silent = []
    for path in source_files("pipeline", "serving", "stages"):
        lines = path.read_text().splitlines()
        for fn in ast.walk(tree(path)):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    here = lines[node.lineno - 1]
                    above = lines[max(fn.lineno, node.lineno - 4) : node.lineno - 1]  # the block's reason
                    if "#" not in here and not any("#" in line for line in above):
                        silent.append(f"{path.relative_to(ROOT)}:{node.lineno}: {here.strip()}")
    assert not silent, "imports inside functions without a reason:\n" + "\n".join(silent)


def trivial(path: Path) -> bool:
    """A module of a docstring (and a ``__version__``) alone: nothing in it can change what a stage does."""

    def inert(n: ast.stmt) -> bool:
        if isinstance(n, ast.Expr):
            return isinstance(n.value, ast.Constant)
        return isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["__version__"]

    return all(inert(n) for n in tree(path).body)


@pytest.mark.parametrize("stage", sorted(p.stem for p in (ROOT / "stages").glob("*.py")))
def test_dvc_sees_every_change_to_the_code_a_stage_runs(stage):
    deps = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["deps"]
    dep_paths = [ROOT / d for d in deps]
    uncovered = []
    for name in sorted(closure(f"stages.{stage}")):
        path = module_file(name)
        if trivial(path):
            continue
        if not any(path == d or d in path.parents for d in dep_paths):
            uncovered.append(str(path.relative_to(ROOT)))
    assert not uncovered, f"dvc.yaml stage {stage} runs code it does not depend on: {uncovered}"


def test_the_training_fingerprint_covers_the_train_stage_code():
    covered = set(code_files())
    runs = {module_file(n) for n in closure("stages.train")}
    assert {p for p in runs if not trivial(p)} <= covered


def pinned() -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return out


def test_the_lock_satisfies_the_declared_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = pinned()
    for spec in project["dependencies"]:
        req = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in lock, f"{req.name} is declared in pyproject.toml but not pinned in requirements.txt"
        assert req.specifier.contains(lock[name].split("+")[0]), f"{req.name}=={lock[name]} is outside {req.specifier}"
