"""What a user's install carries: the wheel leaves out the local cluster harness and the
virtual-clock simulator (repository tools), so no module it ships may import them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parent.parent


def excluded() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return config["tool"]["hatch"]["build"]["targets"]["wheel"]["exclude"]


def module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def test_the_wheel_leaves_out_the_cluster_harness_and_the_simulator():
    assert set(excluded()) == {"ftslurm/localcluster", "ftslurm/backends/mock/virtual.py"}
    for path in excluded():
        assert (REPO / path).exists(), path  # still in the repository


def test_no_shipped_module_imports_what_the_wheel_leaves_out():
    left_out = [module_of(p) for p in excluded()]
    offenders = []
    for source in sorted((REPO / "ftslurm").rglob("*.py")):
        rel = source.relative_to(REPO).as_posix()
        if any(rel == p or rel.startswith(p + "/") for p in excluded()):
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            offenders += [
                f"{rel}: {n}"
                for n in names
                if any(n == m or n.startswith(m + ".") for m in left_out)
            ]
    assert not offenders, offenders
