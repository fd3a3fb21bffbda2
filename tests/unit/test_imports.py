"""Imports flow one way (STYLE.md, docs/architecture.md): a walk over every module's ``import``
statements (function-level ones included) with ``ast``, so a wrong-way import fails here, not in
production.

    schemas <- control_plane <- infra.models <- infra.runtime <- infra.stores
                                 infra.content <-'                 ^
        projections.ledger | projections.readmodel | projections.history | projections.reports
        edge | workers          (each on infra and the core; never on one another)
        bench, infra.stack, infra.k8s (tools: anything in the product, never tests)

Nothing in the product, ``bench`` or ``infra`` imports ``tests``; the core (``control_plane``) imports
no I/O, no clock and no randomness (its simulator's command line, ``control_plane/simulator/__main__.py``,
is the one module of the package that may print and time). No two of our modules import each other
through any chain (a cycle), and a function-level import of our own modules says why on its line or
the line above it (``# deferred: <why>``: a measured start-up cost, an optional dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("schemas", "control_plane", "infra", "projections", "edge", "workers")
WALKED = (*PRODUCT, "bench")
OURS = (*WALKED, "tests")

_APPS = ("projections", "edge", "workers", "bench", "tests")
# package prefix -> prefixes of our modules it must never import (every rule whose prefix matches applies)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "schemas": ("control_plane", "infra", *_APPS),
    "control_plane": ("infra", *_APPS),
    "infra.models": ("infra.runtime", "infra.stores", "infra.content", *_APPS),
    "infra.content": ("infra.stores", *_APPS),
    "infra.runtime": ("infra.stores", "infra.content", *_APPS),
    "infra.stores": ("infra.content", *_APPS),
    "infra": ("tests",),  # the deployment tools (infra.stack, infra.k8s) may read any product package
    "projections.ledger": ("projections.readmodel", "projections.history", "projections.reports"),
    "projections.readmodel": ("projections.ledger", "projections.history", "projections.reports"),
    "projections.history": ("projections.ledger", "projections.readmodel", "projections.reports"),
    "projections.reports": ("projections.ledger", "projections.readmodel", "projections.history"),
    "projections": ("edge", "workers", "bench", "tests"),
    "edge": ("workers", "projections", "bench", "tests"),
    "workers": ("edge", "projections", "bench", "tests"),
    "bench": ("tests",),
}
# Standard-library and third-party modules that mean I/O, a clock or randomness.
CORE_FORBIDDEN_MODULES = (
    "asyncio", "socket", "time", "datetime", "random", "secrets", "uuid", "os", "sys", "argparse", "logging",
    "subprocess", "threading", "pathlib", "io", "shutil", "tempfile", "signal", "select",
    "aiokafka", "faust", "cassandra", "fastapi", "starlette", "uvicorn", "httpx", "prometheus_client",
)
CORE_CLI = "control_plane.simulator.__main__"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def python_files(top: str) -> list[Path]:
    base = ROOT / top
    if base.is_file():
        return [base]
    return sorted(p for p in base.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            # ``from pkg import submodule`` imports pkg.submodule too.
            out.extend((node.lineno, f"{mod}.{alias.name}") for alias in node.names)
    return out


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations() -> list[str]:
    found: list[str] = []
    files = [p for top in WALKED for p in python_files(top)]
    assert len(files) > 50, "the walk found too few modules: is ROOT right?"
    for path in files:
        name = module_name(path)
        rules = [prefix for prefix in FORBIDDEN if _within(name, prefix)]
        for line, mod in imported_modules(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            for prefix in rules:
                for banned in FORBIDDEN[prefix]:
                    if _within(mod, banned):
                        found.append(f"{where}: {name} imports {mod} ({prefix} must not import {banned})")
            if _within(name, "control_plane") and name != CORE_CLI:
                top = mod.split(".")[0]
                if top in CORE_FORBIDDEN_MODULES:
                    found.append(f"{where}: {name} imports {mod}: the core does no I/O, reads no clock, draws no randomness")
    return found


def _ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def import_graph() -> dict[str, set[str]]:
    """Our module -> our modules it imports (resolved to modules that exist: ``from pkg import name``
    counts as ``pkg.name`` only where that is a module)."""
    files = {module_name(p): p for top in WALKED for p in python_files(top)}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges = set()
        for _, mod in imported_modules(path):
            while mod and mod not in files:
                mod = mod.rpartition(".")[0]
            if mod and mod != name and _ours(mod):
                edges.add(mod)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def undeclared_deferred_imports() -> list[str]:
    """Function-level imports of our own modules without a ``# deferred:`` comment saying why: on the
    import's own lines or above it, where a comment heads a block of imports (comment lines and
    import statements in between)."""
    found: list[str] = []
    for top in ("schemas", "control_plane", "infra", "projections", "edge", "workers"):
        for path in python_files(top):
            lines = path.read_text().splitlines()
            tree = ast.parse("\n".join(lines), str(path))
            import_lines = {
                n for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
            }
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        mods = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        mods = [node.module or ""] if not node.level else ["(relative)"]
                    else:
                        continue
                    if not any(_ours(m) or m == "(relative)" for m in mods):
                        continue
                    own = lines[node.lineno - 1: node.end_lineno or node.lineno]
                    declared = any("# deferred:" in line for line in own)
                    n = node.lineno - 1
                    while not declared and n >= 1 and (n in import_lines or lines[n - 1].strip().startswith("#")):
                        declared = "# deferred:" in lines[n - 1]
                        n -= 1
                    if not declared:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {', '.join(mods)}")
    return found


def test_imports_flow_one_way_and_the_core_is_pure():
    assert violations() == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_function_level_imports_of_our_modules_say_why():
    assert undeclared_deferred_imports() == []


def test_the_cycle_check_finds_a_planted_cycle():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert cycles(graph) == [["a.x", "a.y", "a.z"]]
    assert cycles({"a.x": {"a.y"}, "a.y": set()}) == []


def test_the_cycle_check_walks_the_real_tree(tmp_path: Path):
    # Two planted modules of workers that import each other at function level: found as one cycle.
    tag = tmp_path.name[-8:]
    one, two = ROOT / "workers" / f"cyc_a_{tag}.py", ROOT / "workers" / f"cyc_b_{tag}.py"
    one.write_text(f"def f():\n    import workers.cyc_b_{tag}  # deferred: planted\n")
    two.write_text(f"import workers.cyc_a_{tag}\n")
    try:
        found = cycles(import_graph())
    finally:
        one.unlink()
        two.unlink()
    assert [f"workers.cyc_a_{tag}", f"workers.cyc_b_{tag}"] in found


def test_an_undeclared_function_level_import_is_caught(tmp_path: Path):
    target = ROOT / "edge" / f"deferred_{tmp_path.name[-8:]}.py"
    target.write_text("def f():\n    from schemas.codes import Tier\n    return Tier\n")
    try:
        found = undeclared_deferred_imports()
    finally:
        target.unlink()
    assert any(target.name in v for v in found), found


def test_a_deferred_comment_covers_the_block_of_imports_under_it(tmp_path: Path):
    target = ROOT / "edge" / f"deferred_{tmp_path.name[-8:]}.py"
    target.write_text(
        "def f():\n    # deferred: planted\n    from schemas.codes import Tier\n    import schemas.topics\n"
        "    x = 1\n    from schemas.wire import encode\n    return Tier, x, encode\n"
    )
    try:
        found = [v for v in undeclared_deferred_imports() if target.name in v]
    finally:
        target.unlink()
    assert found == [f"edge/{target.name}:6: schemas.wire"]


@pytest.mark.parametrize(
    ("source", "module", "expected"),
    [
        ("from edge.app import build_app\n", "schemas.fake", "schemas must not import edge"),
        ("import infra.runtime.settings\n", "control_plane.fake", "control_plane must not import infra"),
        ("import time\n", "control_plane.fake", "the core does no I/O"),
        ("from random import Random\n", "control_plane.fake", "the core does no I/O"),
        ("import infra.runtime.settings\n", "infra.models.fake", "infra.models must not import infra.runtime"),
        ("import infra.stores.history\n", "infra.content.fake", "infra.content must not import infra.stores"),
        ("import infra.stores.schema\n", "infra.runtime.fake", "infra.runtime must not import infra.stores"),
        ("import projections.readmodel.writer\n", "infra.stores.fake", "infra.stores must not import projections"),
        ("def f():\n    from tests.models import SIM_ALIAS\n", "infra.fake", "infra must not import tests"),
        ("import projections.readmodel.writer\n", "projections.ledger.fake", "projections.ledger must not import projections.readmodel"),
        ("import projections.ledger.processor\n", "projections.readmodel.fake", "projections.readmodel must not import projections.ledger"),
        ("import projections.readmodel.metrics\n", "projections.history.fake", "projections.history must not import projections.readmodel"),
        ("import projections.history.writer\n", "projections.reports.fake", "projections.reports must not import projections.history"),
        ("from edge import app\n", "projections.fake", "projections must not import edge"),
        ("from workers.worker import Worker\n", "edge.fake", "edge must not import workers"),
        ("import projections.ledger.processor\n", "edge.fake", "edge must not import projections"),
        ("from edge import app\n", "workers.fake", "workers must not import edge"),
        ("import projections.readmodel.writer\n", "workers.fake", "workers must not import projections"),
        ("from tests.models import SIM_ALIAS\n", "bench.fake", "bench must not import tests"),
    ],
)
def test_the_check_catches_a_wrong_way_import(tmp_path: Path, monkeypatch, source: str, module: str, expected: str):
    # The same walk over one planted module: the check can fail.
    *pkg, leaf = module.split(".")
    target = ROOT.joinpath(*pkg, f"{leaf}_{tmp_path.name[-8:]}.py")
    target.write_text(source)
    try:
        found = violations()
    finally:
        target.unlink()
    assert any(expected in v and target.name in v for v in found), found
