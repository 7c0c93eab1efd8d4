"""Structural rules: the decision core stays pure; documented layout matches the code."""

from __future__ import annotations

import ast
import re
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
    "subprocess",
    "sqlite3",
    "socket",
    "time",
    "os",
    "shutil",
    "threading",
    "rich",
    "typer",
    "torch",
    "tenacity",
    "ftslurm.backends",
    "ftslurm.localcluster",
    "ftslurm.cli",
}


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
    bad = {
        m
        for m in imported_modules(path)
        if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE)
    }
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_slurm_parsers_are_pure():
    bad = imported_modules(PACKAGE / "backends" / "slurm_cli" / "parse.py") & {
        "subprocess",
        "os",
        "time",
        "ftslurm.backends.slurm_cli.runner",
    }
    assert not bad


def test_slurm_cli_backend_implements_the_protocol():
    assert isinstance(SlurmCliBackend(), SchedulerBackend)


def test_architecture_doc_names_every_module():
    """A newcomer finds every module's room: each file under ftslurm/ is named in the doc,
    by its dotted name or by its file name."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        dotted = ".".join(path.with_suffix("").relative_to(ROOT).parts)
        if f"`{path.name}`" not in doc and f"`{dotted}`" not in doc:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/architecture.md does not name {missing}"


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


@pytest.mark.parametrize("name", ["policy.py", "step.py", "records.py", "submission.py"])
def test_daemon_decisions_are_pure(name):
    """The daemon's decisions (`step`, `policy`), the records they read and the batch script
    of an attempt (`submission`) do no I/O, and import nothing of the daemon's shell (the
    store, the loop, the agent; the decisions nothing of `submission` either)."""
    shell = {
        "ftslurm.daemon.store",
        "ftslurm.daemon.reconcile",
        "ftslurm.daemon.service",
        "ftslurm.daemon.submission",
        "ftslurm.agent",
        "ftslurm.fsutil",
    }
    shell.discard(f"ftslurm.daemon.{name.removesuffix('.py')}")
    bad = {
        m
        for m in imported_modules(PACKAGE / "daemon" / name)
        if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE | shell)
    }
    assert not bad, f"{name} imports {sorted(bad)}"


def _module_file(name: str) -> Path | None:
    """The file of ftslurm module `name` (a package's `__init__.py`), None for any other."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if name.split(".")[0] == "ftslurm" and path.exists():
            return path
    return None


def _lazy_attribute_imports(tree: ast.Module) -> set[int]:
    """ids of the nodes inside a module-level `__getattr__` (PEP 562): it runs when code
    asks the module for a name it lacks (`ftslurm.SubmititExecutor`), never on import."""
    return {
        id(inner)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
        for inner in ast.walk(node)
    }


def ftslurm_modules_loaded(name: str) -> set[str]:
    """The ftslurm modules that importing `name` can load: followed through every import
    (also those inside functions, but not those of a module's `__getattr__`), with the
    packages each one sits in."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        module = todo.pop()
        if module in seen or _module_file(module) is None:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        tree = ast.parse(_module_file(module).read_text())  # type: ignore[union-attr]
        lazy = _lazy_attribute_imports(tree)
        for node in ast.walk(tree):
            if id(node) in lazy:
                continue
            if isinstance(node, ast.Import):
                todo += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                todo.append(node.module)  # and `from package import module`:
                todo += [f"{node.module}.{alias.name}" for alias in node.names]
    return seen


# The layers that talk to the world: schedulers, the terminal, the state database, the
# daemon's loop and process, the compute side, the local cluster.
IO_LAYERS = (
    "ftslurm.backends",
    "ftslurm.cli",
    "ftslurm.localcluster",
    "ftslurm.agent",
    "ftslurm.daemon.store",
    "ftslurm.daemon.reconcile",
    "ftslurm.daemon.service",
    "ftslurm.daemon.as_job",
)


@pytest.mark.parametrize(
    "name",
    [
        "ftslurm.daemon.policy",
        "ftslurm.daemon.step",
        "ftslurm.daemon.records",
        "ftslurm.daemon.submission",
        "ftslurm.report.goodput",
        "ftslurm.report.notes",
    ],
)
def test_pure_modules_reach_no_io_layer_through_their_imports(name):
    """Not even through a module they import (the batch script's template once imported
    the Slurm CLI backend for its sbatch flags, so `submission` loaded a backend)."""
    bad = {
        m
        for m in ftslurm_modules_loaded(name)
        if any(m == f or m.startswith(f + ".") for f in IO_LAYERS)
    }
    assert not bad, f"{name} loads {sorted(bad)}"


# The launcher's decisions (pure, like the daemon's `step`) and the hot spares' rules they use.
LAUNCHER_CORE = [
    "ftslurm.agent.launch_core",
    "ftslurm.agent.spare_rules",
    "ftslurm.agent.live_rules",  # live recovery's decisions
    "ftslurm.agent.validation_rules",  # result validation's decisions
    "ftslurm.agent.health_rules",  # the pre-flight health check's rules
]
# What of the compute side they may load: each other, the package and `boot` (the signals
# that stop a launcher: names, no I/O).
LAUNCHER_CORE_MAY_LOAD = {"ftslurm.agent", "ftslurm.agent.boot", *LAUNCHER_CORE}


@pytest.mark.parametrize("name", LAUNCHER_CORE)
def test_the_launchers_decisions_are_pure(name):
    """The launcher's decision core reads no clock, file or process, and reaches no module
    that does through its imports (the I/O of the spares, the peers, torch's agent stay in
    the shell: `ftslurm.agent.launch`, `ftslurm.agent.elastic`)."""
    loaded = ftslurm_modules_loaded(name)
    bad = {
        m
        for m in loaded - LAUNCHER_CORE_MAY_LOAD
        if any(m == f or m.startswith(f + ".") for f in IO_LAYERS)
    }
    assert not bad, f"{name} loads {sorted(bad)}"
    for module in loaded & LAUNCHER_CORE_MAY_LOAD:
        path = _module_file(module)
        assert path is not None
        imports = {
            m
            for m in imported_modules(path)
            if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE | {"ftslurm.fsutil"})
        }
        assert not imports, f"{module} (loaded by {name}) imports {sorted(imports)}"


@pytest.mark.parametrize("path", sorted((PACKAGE / "report").glob("*.py")), ids=lambda p: p.name)
def test_reporting_is_pure(path):
    """The reporting package (goodput, the commands' prose) reads no clock, file or
    terminal: values in, words and numbers out."""
    bad = {
        m
        for m in imported_modules(path)
        if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE)
    }
    assert not bad, f"{path.name} imports {sorted(bad)}"


def test_settings_live_in_the_core_and_nothing_imports_them_from_the_daemon():
    assert "ftslurm.daemon.policy" not in imported_modules(PACKAGE / "recipe.py")
    assert "ftslurm.agent.heartbeat" not in imported_modules(PACKAGE / "core" / "settings.py")


# ---------------------------------------------------------------- the compute/daemon contract
CONTRACT = PACKAGE / "core" / "contract"  # a package: __init__ (paths, env) and reports
CONTRACT_MODULES = sorted(CONTRACT.glob("*.py"))
# What the contract modules may import: parsing and path arithmetic, nothing with I/O.
CONTRACT_IMPORTS = {
    "__future__",
    "json",
    "re",
    "signal",
    "collections.abc",
    "dataclasses",
    "enum",
    "pathlib",
    "typing",
    "pydantic",
    "ftslurm.errors",
    "ftslurm.core.contract",
    "ftslurm.core.contract.reports",  # the rendezvous record's model (its own modules)
}
# FTSLURM_* variables that are not the job's: the login node's state folder, the mock
# scheduler's own plumbing and the local test cluster's markers. Each is named by the module
# that owns it; every other FTSLURM_* name lives in the contract module.
OWN_VARIABLES = {
    "FTSLURM_HOME",
    "FTSLURM_MOCK_HOME",
    "FTSLURM_MOCK_JOB_DIR",
    "FTSLURM_TEST_PAUSE_AFTER_RECORD",
    "FTSLURM_TEST_PAUSE_LAUNCH",
    "FTSLURM_TEST_PAUSE_LIVE",
    "FTSLURM_LOCAL_CLUSTER",
    "FTSLURM_LOCAL_NODE",
    "FTSLURM_LOCAL_CLUSTER_DIR",
    "FTSLURM_ROOTFS_CACHE",
    "FTSLURM_DEBIAN_MIRROR",
    "FTSLURM_STATE_FS",
    "FTSLURM_CLUSTER_OPERATOR",
}
# The files the two sides share (ftslurm.core.contract.RunDir, HeartbeatDir): a string that is
# one of these names, or begins or ends like one, spells a shared file out again.
SHARED_NAMES = {
    "progress.json",
    "FINISHED",
    "straggler-nodes.json",
    "report.json",
    "state.json",
    "sections.json",
    ".ftslurm-observed",
}
SHARED_PREFIXES = (
    "rank-",
    "node-",
    "stopping-rank-",
    "hung-node-",
    "fired-rank-",
    "ready-",
    "peer-lease-",
    "lost-",
    "round-",
    "benched-",
    "rendezvous-",
    "launcher-failed-",
    "ftslurm-hb-",
    "job-%j",
)
SHARED_SUFFIXES = (".hb",)
# Folder names too common to forbid everywhere: forbidden as a path component (`x / "logs"`).
SHARED_FOLDERS = {"attempts", "logs", "stragglers", "checkpoints", "recovery"}
_VARIABLE = re.compile(r"FTSLURM_[A-Z0-9_]+")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (module, class, function): prose, not code."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                found.add(id(body[0].value))
    return found


def _strings(path: Path) -> list[tuple[int, str, bool]]:
    """(line, text, used as a path component) of every string literal in code, f-string
    parts included, docstrings left out."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    components = {
        id(n.right)
        for n in ast.walk(tree)
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
    }
    return [
        (n.lineno, n.value, id(n) in components)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip
    ]


def _outside_contract() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if CONTRACT not in p.parents]


@pytest.mark.parametrize("module", CONTRACT_MODULES, ids=lambda p: p.name)
def test_contract_module_imports_nothing_with_io(module):
    extra = imported_modules(module) - CONTRACT_IMPORTS
    assert not extra, f"contract/{module.name} imports {sorted(extra)}"


def test_no_module_outside_the_contract_spells_a_job_variable():
    from ftslurm.core.contract import EnvName

    contract_names = {n.value for n in EnvName}
    found = []
    for path in _outside_contract():
        for line, text, _ in _strings(path):
            for name in _VARIABLE.findall(text):
                if name in contract_names or name not in OWN_VARIABLES:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not found, "spell these through ftslurm.core.contract.EnvName/JobEnv:\n" + "\n".join(
        found
    )


def test_no_module_outside_the_contract_spells_a_shared_file_name():
    found = []
    for path in _outside_contract():
        for line, text, component in _strings(path):
            if (
                text in SHARED_NAMES
                or text.startswith(SHARED_PREFIXES)
                or text.endswith(SHARED_SUFFIXES)
                or (component and text in SHARED_FOLDERS)
            ):
                found.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not found, "name these through ftslurm.core.contract.RunDir/HeartbeatDir:\n" + "\n".join(
        found
    )


@pytest.mark.parametrize("name", ["reconcile.py", "submission.py", "step.py"])
def test_the_daemon_reaches_the_compute_side_only_through_the_contract(name):
    bad = {
        m
        for m in imported_modules(PACKAGE / "daemon" / name)
        if m == "ftslurm.agent" or m.startswith("ftslurm.agent.")
    }
    assert not bad, f"{name} imports {sorted(bad)}"
