"""Imports flow one way (STYLE.md, docs/architecture.md): a walk over every module's ``import``
statements (function-level ones included) with ``ast``, so a wrong-way import fails here, not in
production.

    schemas <- control_plane <- projections.shared <- projections.readmodel <- projections.ledger
                                        ^                       ^
                                        `------ edge, workers --'   (never the processor, never each other)

Nothing in the product imports ``tests``; the core (``control_plane``) imports no I/O, no clock and
no randomness (its simulator's command line, ``control_plane/simulator/__main__.py``, is the one
module of the package that may print and time).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("schemas", "control_plane", "projections", "edge", "workers")
OURS = (*PRODUCT, "tests", "bench", "infra")

# package prefix -> prefixes of our modules it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "schemas": ("control_plane", "projections", "edge", "workers", "tests"),
    "control_plane": ("projections", "edge", "workers", "tests"),
    "projections.shared": ("projections.ledger", "projections.readmodel", "edge", "workers", "tests"),
    "projections.readmodel": ("projections.ledger", "edge", "workers", "tests"),
    "projections.ledger": ("edge", "workers", "tests"),
    "projections": ("edge", "workers", "tests"),
    "edge": ("workers", "projections.ledger", "projections.__main__", "tests"),
    "workers": ("edge", "projections.ledger", "projections.__main__", "tests"),
    "infra": ("tests",),
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
    files = [p for top in (*PRODUCT, "infra/stack.py") for p in python_files(top)]
    assert len(files) > 50, "the walk found too few modules: is ROOT right?"
    for path in files:
        name = module_name(path) if not path.name == "stack.py" else "infra.stack"
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


def test_imports_flow_one_way_and_the_core_is_pure():
    assert violations() == []


@pytest.mark.parametrize(
    ("source", "module", "expected"),
    [
        ("from workers.worker import Worker\n", "edge.fake", "edge must not import workers"),
        ("import projections.ledger.processor\n", "workers.fake", "workers must not import projections.ledger"),
        ("def f():\n    from tests.models import SIM_ALIAS\n", "projections.shared.fake", "must not import tests"),
        ("import time\n", "control_plane.fake", "the core does no I/O"),
        ("from random import Random\n", "control_plane.fake", "the core does no I/O"),
        ("from edge import app\n", "workers.fake", "workers must not import edge"),
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
