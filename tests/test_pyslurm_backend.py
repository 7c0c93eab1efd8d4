"""The optional pyslurm backend: converters on stand-in objects; live tests skip with reason."""

from __future__ import annotations

import builtins
import sys
import types

import pytest

from ftslurm.backends import pyslurm_backend as pb
from ftslurm.core.types import JobOptions, JobState, NodeState
from ftslurm.errors import ConfigError, InvalidJobId, SchedulerRejected, SchedulerUnavailable

NOW = 1_800_000_000.0


def fake_job(**fields):
    base = dict(
        id=42,
        state="RUNNING",
        allocated_nodes="n[1-2]",
        exit_code=0,
        exit_code_signal=0,
        submit_time=NOW - 10,
        start_time=NOW - 5,
        end_time=0,
        time_limit=90,
        requeue_count=1,
        state_reason="None",
        name="train",
        comment="ftslurm:run=x",
    )
    base.update(fields)
    return types.SimpleNamespace(**base)


def test_job_conversion():
    info = pb.job_info_from_pyslurm(fake_job(), NOW)
    assert (info.job_id, info.state, info.nodes) == ("42", JobState.RUNNING, ("n1", "n2"))
    assert (info.time_limit_s, info.restart_count, info.signal) == (5400, 1, None)
    assert info.start_time == NOW - 5 and info.end_time is None and not info.from_accounting
    failed = pb.job_info_from_pyslurm(
        fake_job(state="FAILED", exit_code=0, exit_code_signal=9, end_time=NOW), NOW
    )
    assert (failed.state, failed.signal, failed.end_time) == (JobState.FAILED, 9, NOW)
    pending = pb.job_info_from_pyslurm(
        fake_job(state="PENDING", allocated_nodes=None, time_limit=None), NOW
    )
    assert pending.nodes == () and pending.start_time is None and pending.time_limit_s is None
    assert pb.job_info_from_pyslurm(fake_job(state="WHATEVER"), NOW).state is JobState.UNKNOWN


def test_node_and_facts_conversion():
    node = pb.node_info_from_pyslurm(
        types.SimpleNamespace(name="n2", state="DOWN+NOT_RESPONDING", reason="Not responding")
    )
    assert (node.state, node.reason) == (NodeState.DOWN, "Not responding")
    facts = pb.facts_from_pyslurm(
        types.SimpleNamespace(
            min_job_age=60,
            accounting_storage_type="accounting_storage/slurmdbd",
            kill_wait=10,
            job_requeue=True,
            cluster_name="c",
        ),
        "25.11.2",
    )
    assert (facts.min_job_age_s, facts.accounting, facts.kill_wait_s) == (60, True, 10)


def test_submit_description():
    kwargs = pb.submit_description_kwargs(
        "#!/bin/bash\n",
        JobOptions(
            name="t", nodes=2, time_limit="1:30:00", exclude=("n1",), hold=True, requeue=False
        ),
    )
    assert kwargs["time_limit"] == 90 and kwargs["excluded_nodes"] == ["n1"]
    assert kwargs["priority"] == 0 and kwargs["is_requeueable"] is False
    with pytest.raises(ConfigError):
        pb.submit_description_kwargs("#!/bin/bash\n", JobOptions(extra={"qos": "x"}))


def test_rpc_errors_become_typed_errors():
    assert isinstance(pb._translate(Exception("Invalid job id specified")), InvalidJobId)
    err = pb._translate(Exception("Unable to contact slurm controller (connect failure)"))
    assert isinstance(err, SchedulerUnavailable)
    assert type(pb._translate(Exception("something else"))) is SchedulerRejected


def _fake_pyslurm(monkeypatch, version):
    module = types.ModuleType("pyslurm")
    module.__version__ = version
    monkeypatch.setitem(sys.modules, "pyslurm", module)


def test_status_when_missing(monkeypatch):
    real_import = builtins.__import__

    def no_pyslurm(name, *args, **kwargs):
        if name == "pyslurm":
            raise ImportError("No module named 'pyslurm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "pyslurm", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_pyslurm)
    usable, why = pb.pyslurm_status("22.05.8")
    assert not usable and why.startswith("pyslurm is not installed")


def test_status_on_version_mismatch_and_match(monkeypatch):
    _fake_pyslurm(monkeypatch, "25.11.2")
    assert pb.pyslurm_status("22.05.8") == (False, "pyslurm 25.11.2 does not match Slurm 22.05.8")
    assert pb.pyslurm_status("25.11.0")[0] is True


def test_live_pyslurm_backend(backend):
    """Against the real cluster, only where a matching pyslurm imports (never on our CI)."""
    usable, why = pb.pyslurm_status(backend.cluster_facts().version)
    if not usable:
        pytest.skip(f"pyslurm backend not usable here: {why}")
    live = pb.PyslurmBackend()
    assert {n.name for n in live.nodes()} == {n.name for n in backend.nodes()}
