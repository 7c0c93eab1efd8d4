"""The shared report files as the contract's models (`ftslurm.core.contract.reports`): what
the launcher writes today validates, a file of another version reads, a damaged one is
left out, and no module outside the contract spells an outcome or a report's key again."""

from __future__ import annotations

import ast
import inspect
import json
from fnmatch import fnmatch
from pathlib import Path

import pytest

from ftslurm.core import contract
from ftslurm.core.contract import RunDir
from ftslurm.core.contract.reports import (
    REPORT_ONLY_KEYS,
    HungNodeReport,
    Kind,
    LauncherFailed,
    NodeReport,
    Outcome,
    RankReport,
)
from ftslurm.runfiles import read_reports, write_report

PACKAGE = Path(__file__).resolve().parent.parent / "ftslurm"
CONTRACT = PACKAGE / "core" / "contract"

# The launcher's node reports as ftslurm.agent.launch writes them (every key it writes).
LAUNCH_NODE_REPORT = {
    "node_rank": 1,
    "node": "n2",
    "job_id": "12",
    "attempt": 0,
    "in_job_restarts": 1,
    "max_restarts": 3,
    "spare_swaps": 0,
    "role": None,
    "recovery": None,
    "hangs": [{"time": 5.0, "local_rank": 0, "reason": "silent"}],
    "outcome": "checkpointed",
    "exit_code": 75,
    "teardown_failures": [],
    "started_at": 1.0,
    "ended_at": 2.0,
    "timeouts": {"sections": {}, "out_of_section": 60.0, "initial": None, "warmup_steps": 3},
    "heartbeats": True,
    "peers_lost": [2],
    "checkpoint_signal_withheld_ranks": [4, 5],
}
LAUNCH_FAILED = {
    "node_rank": 1,
    "node": "n2",
    "job_id": "12",
    "attempt": 0,
    "error": "OSError: cannot bind",
    "phase": "rendezvous",
    "exit_code": 1,
    "time": 3.0,
}
LAUNCH_STOPPED = {
    **{k: LAUNCH_FAILED[k] for k in ("node_rank", "node", "job_id", "attempt")},
    "outcome": "stopped",
    "signal": "SIGTERM",
    "exit_code": 143,
    "in_job_restarts": 0,
    "max_restarts": 3,
    "started_at": 1.0,
    "ended_at": 2.0,
    "peers_lost": [],
}
LAUNCH_HUNG = {
    "node_rank": 0,
    "node": "n1",
    "time": 9.0,
    "hung": [{"local_rank": 1, "rank": 1, "reason": "silent", "section": "step", "silent_s": 4.0}],
}


@pytest.mark.parametrize(
    "model, data",
    [
        (NodeReport, LAUNCH_NODE_REPORT),
        (NodeReport, {**LAUNCH_FAILED, "outcome": "launcher_failed", "peers_lost": []}),
        (NodeReport, LAUNCH_STOPPED),
        (LauncherFailed, LAUNCH_FAILED),
        (HungNodeReport, LAUNCH_HUNG),
    ],
)
def test_what_the_launcher_writes_today_validates_and_writes_back_the_same(model, data):
    assert model.model_validate(data).to_json() == data


def test_a_file_of_another_version_reads_and_keeps_what_it_does_not_know(tmp_path):
    run = RunDir(tmp_path)
    newer = {"rank": 0, "outcome": "a_newer_outcome", "job_id": 7, "new_key": [1]}
    older = {"rank": 1}  # most keys missing
    write_report(run.rank_report(0, 0), RankReport.model_validate(newer))
    write_report(run.rank_report(0, 1), RankReport.model_validate(older))
    run.rank_report(0, 2).write_text('{"rank": 2, "exit_co')  # torn
    run.rank_report(0, 3).write_text(json.dumps({"rank": "three"}))  # not a rank report
    found = read_reports(run, Kind.RANK, 0)
    assert [r.rank for r in found] == [0, 1]
    assert found[0].job_id == "7" and found[0].to_json()["new_key"] == [1]
    assert found[1].injected == [] and found[1].outcome is None
    assert json.loads(run.rank_report(0, 1).read_text()) == older  # only the keys given


# ------------------------------------------------------------------ spelled once, in the contract
# A word that is an outcome but means something else here: another vocabulary's.
OTHER_VOCABULARY = {
    ("daemon/service.py", "stopped"),  # the daemon lease's state
    ("report/goodput.py", "finished"),  # how a span of compute ended
    ("report/goodput.py", "failed"),
    ("benchmarks/goodput.py", "hung"),  # a category of lost time
    ("benchmarks/slurm_recovery.py", "spare"),  # a case's name, a recovery path
    ("benchmarks/slurm_recovery.py", "killed"),  # a result's key: the node it killed
}
OUTCOMES = {o.value for o in Outcome}


BENCHMARKS = PACKAGE.parent / "benchmarks"


def _checked() -> list[Path]:
    """The modules outside the contract, the benchmarks' too (they write reports)."""
    package = [p for p in sorted(PACKAGE.rglob("*.py")) if CONTRACT not in p.parents]
    return [*package, *sorted(BENCHMARKS.rglob("*.py"))]


def _enum_members(tree: ast.AST) -> set[int]:
    """ids of the values of enum members (another vocabulary sharing a word: `Cause`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id.endswith("Enum") for b in node.bases
        ):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign):
                    found.update(id(n) for n in ast.walk(stmt.value))
    return found


def _in_messages(tree: ast.AST) -> set[int]:
    """ids of the constants inside f-strings (words of a message)."""
    return {id(n) for j in ast.walk(tree) if isinstance(j, ast.JoinedStr) for n in ast.walk(j)}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _key_uses(tree: ast.AST) -> list[ast.Constant]:
    """String constants used as a dict's key: `x["k"]`, `x.get("k")`, `{"k": ...}`."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            found.append(node.slice)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
        ):
            found.append(node.args[0])
        elif isinstance(node, ast.Dict):
            found.extend(k for k in node.keys if k is not None)
    return [n for n in found if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_no_module_outside_the_contract_spells_an_outcome():
    found = []
    for path in _checked():
        tree = ast.parse(path.read_text())
        skip = _enum_members(tree) | _in_messages(tree) | _docstrings(tree)
        rel = str(path.relative_to(PACKAGE if PACKAGE in path.parents else PACKAGE.parent))
        for n in ast.walk(tree):
            if (
                isinstance(n, ast.Constant)
                and n.value in OUTCOMES
                and id(n) not in skip
                and (rel, n.value) not in OTHER_VOCABULARY
            ):
                found.append(f"{rel}:{n.lineno}: {n.value!r}")
    assert not found, "spell these as ftslurm.core.contract.reports.Outcome:\n" + "\n".join(found)


def test_no_module_outside_the_contract_reads_a_report_as_a_dict():
    found = []
    for path in _checked():
        rel = str(path.relative_to(PACKAGE.parent))
        for n in _key_uses(ast.parse(path.read_text())):
            if n.value in REPORT_ONLY_KEYS:
                found.append(f"{rel}:{n.lineno}: {n.value!r}")
    assert not found, "read these through the report models:\n" + "\n".join(found)


# The report patterns by the names the contract gives them (`Kind.pattern`).
PATTERNS = {k.pattern for k in Kind}
PATTERN_NAMES = {
    name
    for name, value in vars(contract).items()
    if name.isupper() and isinstance(value, str) and value in PATTERNS
}


def _report_methods() -> set[str]:
    """The methods of `RunDir` that give a report's path (its name matches a pattern)."""
    found = set()
    for name, method in vars(RunDir).items():
        if name.startswith("_") or not inspect.isfunction(method):
            continue
        args = [0] * (len(inspect.signature(method).parameters) - 1)
        if any(fnmatch(method(RunDir("/run"), *args).name, p) for p in PATTERNS):
            found.add(name)
    return found


REPORT_METHODS = _report_methods()


def _names_a_report(node: ast.AST) -> bool:
    """A glob's pattern that finds reports alone: a pattern of the contract by name, or a
    string (an f-string's values read as "*") whose last part a report pattern matches,
    or an f-string made of a report's path (`f"*/{run.rank_report(0, r).name}"`)."""
    if isinstance(node, ast.Name) and node.id in PATTERN_NAMES:
        return True
    if isinstance(node, ast.Attribute) and node.attr in PATTERN_NAMES:
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr):
        for value in node.values:
            if isinstance(value, ast.FormattedValue) and any(
                _names_a_report(n)
                or (isinstance(n, ast.Attribute) and n.attr in REPORT_METHODS)
                or (isinstance(n, ast.Name) and n.id in REPORT_METHODS)
                for n in ast.walk(value.value)
            ):
                return True
        text = "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
    else:
        return False
    last = text.rsplit("/", 1)[-1]
    return any(fnmatch(last, p) for p in PATTERNS)


def _globs_a_report(node: ast.AST) -> bool:
    """`x.glob(P)` (rglob, iglob, glob.glob) of a report pattern `P`: by name, spelled, or
    built in an f-string."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("glob", "rglob", "iglob")
    ):
        return False
    return any(_names_a_report(arg) for arg in node.args)


def test_the_glob_check_sees_every_way_to_spell_a_report_pattern():
    """It missed an f-string once (the task wrapper's rank reports of every attempt)."""
    assert {"rank_report", "node_report", "peer_lost", "round_record"} <= REPORT_METHODS
    globs = [
        "run.attempts.glob(f'*/{run.rank_report(0, rank).name}')",
        "folder.glob(f'rank-{rank}.json')",
        "folder.glob('*/node-*.json')",
        "folder.glob(contract.NODE_REPORTS)",
        "folder.glob(ROUND_RECORDS)",
    ]
    others = ["area.glob(f'*/{node}')", "steps.glob('*.json')", "out.glob('rank-*.node')"]
    assert all(_globs_a_report(ast.parse(g).body[0].value) for g in globs)
    assert not any(_globs_a_report(ast.parse(g).body[0].value) for g in others)


def test_only_runfiles_lists_a_kind_of_report():
    """A report pattern is globbed in `ftslurm.runfiles` alone: a reader elsewhere gets the
    models through it."""
    found = []
    for path in _checked():
        if path == PACKAGE / "runfiles.py":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if _globs_a_report(n):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n.lineno}")
    assert PATTERN_NAMES >= {"RANK_REPORTS", "NODE_REPORTS", "ROUND_RECORDS"}
    assert not found, "read these with ftslurm.runfiles.read_reports:\n" + "\n".join(found)


def test_every_report_model_is_read_or_written_outside_its_definition():
    """A model no module builds or reads is dead: the file it describes is read as a dict
    somewhere (the rendezvous record once was)."""
    from ftslurm.core.contract import reports

    models = {
        name
        for name, value in vars(reports).items()
        if isinstance(value, type)
        and issubclass(value, reports.Report)
        and value.__module__ == reports.__name__
        and value is not reports.Report
    }
    used: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Name) and path.name != "reports.py":
                used.add(n.id)
            elif isinstance(n, ast.alias):
                used.add(n.asname or n.name)
            elif isinstance(n, ast.ClassDef) and path.name == "reports.py":
                # a model another model of the contract holds (a list of them) counts
                used.update(s.id for s in ast.walk(n) if isinstance(s, ast.Name) and s.id != n.name)
    assert models - used == set(), "no module builds or reads these models"


# Reading or writing a file as bytes or JSON rather than as its model.
RAW_IO = {"read_json", "write_json_atomic", "write_bytes_atomic", "open", "loads", "load"}
RAW_METHODS = {"read_text", "write_text", "read_bytes", "write_bytes", "open"}


def _raw_progress(tree: ast.AST) -> list[ast.AST]:
    """progress.json read or written as a dict: `read_json(x.progress)`,
    `x.progress.read_text()`, `write_json_atomic(x.progress, ...)`, or the name spelled."""
    skip = _docstrings(tree)
    found: list[ast.AST] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and n.value == "progress.json" and id(n) not in skip:
            found.append(n)
        if not isinstance(n, ast.Call):
            continue
        func = n.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        progress = [a for a in n.args if isinstance(a, ast.Attribute) and a.attr == "progress"]
        if name in RAW_IO and progress:
            found.append(n)
        if (
            isinstance(func, ast.Attribute)
            and func.attr in RAW_METHODS
            and isinstance(func.value, ast.Attribute)
            and func.value.attr == "progress"
        ):
            found.append(n)
    return found


def test_progress_json_is_read_and_written_as_its_model():
    """`Progress` through `runfiles.read_report` and `write_report`, never a dict."""
    found = []
    for path in _checked():
        for n in _raw_progress(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{n.lineno}")
    assert not found, "read or write these as ftslurm.core.contract.reports.Progress:\n" + (
        "\n".join(found)
    )


def test_a_ranks_reports_of_every_attempt(tmp_path):
    """What the task wrapper reads to know the faults a rank already carried out."""
    from ftslurm.runfiles import rank_reports

    run = RunDir(tmp_path)
    assert rank_reports(run, 1) == []  # no attempt yet
    write_report(run.rank_report(0, 1), RankReport(rank=1, injected=["crash@5s"]))
    write_report(run.rank_report(2, 1), RankReport(rank=1, injected=["hang@9s"]))
    write_report(run.rank_report(2, 0), RankReport(rank=0, injected=["crash@1s"]))
    run.attempt(1).mkdir()
    run.rank_report(1, 1).write_text('{"rank": 1, "inj')  # torn
    assert [r.injected for r in rank_reports(run, 1)] == [["crash@5s"], ["hang@9s"]]


def test_a_node_reports_hangs_are_models_and_a_damaged_one_is_left_out():
    data = {**LAUNCH_NODE_REPORT, "hangs": [*LAUNCH_NODE_REPORT["hangs"], "junk", {"time": []}]}
    report = NodeReport.model_validate(data)
    assert [(h.local_rank, h.reason, h.time) for h in report.hangs] == [(0, "silent", 5.0)]
    assert NodeReport.model_validate(LAUNCH_NODE_REPORT).to_json() == LAUNCH_NODE_REPORT
