"""Structural rules: the decision core stays pure; documented layout matches the code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.backends.slurm_cli import SlurmCliBackend
from ftslurm.localcluster.config import (
    ClusterLayout,
    render_slurm_conf,
    render_slurmdbd_conf,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ftslurm"
# What the pure core may never import: I/O, clocks, processes, UI, the shell layers.
FORBIDDEN_IN_CORE = {
    "subprocess", "sqlite3", "socket", "time", "os", "shutil", "threading", "rich", "typer",
    "torch", "tenacity", "ftslurm.backends", "ftslurm.localcluster", "ftslurm.cli",
}  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted((PACKAGE / "core").rglob("*.py")), ids=lambda p: p.name)
def test_core_modules_do_no_io(path):
    bad = {m for m in imported_modules(path)
           if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE)}  # fmt: skip
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_slurm_parsers_are_pure():
    bad = imported_modules(PACKAGE / "backends" / "slurm_cli" / "parse.py") & {
        "subprocess", "os", "time", "ftslurm.backends.slurm_cli.runner"}
    assert not bad


def test_slurm_cli_backend_implements_the_protocol():
    assert isinstance(SlurmCliBackend(), SchedulerBackend)


def test_architecture_doc_names_every_package():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for package in sorted(p.parent for p in PACKAGE.rglob("__init__.py")):
        dotted = ".".join(package.relative_to(ROOT).parts)
        assert f"`{dotted}`" in doc, f"docs/architecture.md does not mention {dotted}"


def test_local_cluster_config_gives_each_slurmd_its_own_files_and_never_uses_etc(tmp_path):
    lay = ClusterLayout(root=tmp_path, hostname="host")
    conf = render_slurm_conf(lay)
    assert "NodeName=n[1-4] NodeHostname=host NodeAddr=127.0.0.1 Port=16901-16904 CPUs=2" in conf
    for key in ("SlurmdSpoolDir", "SlurmdPidFile", "SlurmdLogFile"):
        line = next(ln for ln in conf.splitlines() if ln.startswith(key + "="))
        assert "%n" in line, key
    assert "/etc/" not in conf and "/etc/" not in render_slurmdbd_conf(lay)
    assert f"AuthInfo=socket={lay.munge_socket}" in conf
    assert "AccountingStorageType=accounting_storage/slurmdbd" in conf


@pytest.mark.parametrize("name", ["policy.py", "step.py", "records.py"])
def test_daemon_decisions_are_pure(name):
    """The daemon's decisions (`step`, `policy`) and the records they read do no I/O, and
    import nothing of the daemon's shell (the store, the loop, submission, the agent)."""
    shell = {"ftslurm.daemon.store", "ftslurm.daemon.reconcile", "ftslurm.daemon.service",
             "ftslurm.daemon.submission", "ftslurm.agent", "ftslurm.fsutil"}  # fmt: skip
    bad = {m for m in imported_modules(PACKAGE / "daemon" / name)
           if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE | shell)}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_settings_live_in_the_core_and_nothing_imports_them_from_the_daemon():
    assert "ftslurm.daemon.policy" not in imported_modules(PACKAGE / "recipe.py")
    assert "ftslurm.agent.heartbeat" not in imported_modules(PACKAGE / "core" / "settings.py")
