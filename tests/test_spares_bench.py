"""Hot spares for a node that is not lost but bad: a node whose ranks hang, or a persistent
straggler, steps out (`recovery/benched-<n>.json`) and a spare takes its place in the job."""

from __future__ import annotations

import json
import os
import signal

import pytest

from ftslurm.agent import spares as sp
from ftslurm.core.contract import PEER_LOST_REPORTS, ROUND_RECORDS, RunDir
from ftslurm.core.contract.reports import Benched, PeerLost

from .daemon_scenarios import (
    reference_digest,
    spare_takes_over_on_the_mock,
    training_process,
)
from .test_spares import Launchers, node_report

NOW = 1_000.0


# ---------------------------------------------------------------- the rules (pure)
def test_a_node_steps_out_only_while_a_spare_can_take_its_place():
    assert sp.may_step_out(1, (), 1)
    assert sp.may_step_out(2, (1,), 2)  # one spare used, one left
    assert not sp.may_step_out(2, (1,), 1)  # the only spare is taken
    assert not sp.may_step_out(1, (), 0)  # no spares at all


def test_the_batch_host_never_steps_out():
    assert not sp.may_step_out(0, (), 3)


def test_a_node_already_gone_counts_once():
    assert sp.may_step_out(1, (1,), 1)  # its own record, read back


REPORT = {
    "attempt": 0,
    "persistent_nodes": ["n1"],
    "threshold": 0.75,
    "scores": [
        {"node": "n1", "relative": 0.3, "individual": 0.9},
        {"node": "n1", "relative": 0.5, "individual": 0.4},
        {"node": "n0", "relative": 1.0, "individual": 1.0},
    ],
}


def test_the_straggler_report_names_a_node_with_its_worst_score():
    assert sp.straggler_reason(REPORT, 0, "n1") == "persistent straggler: score 0.30 below 0.75"


@pytest.mark.parametrize(
    "report, attempt, node",
    [
        (REPORT, 0, "n0"),  # scored but not persistent
        (REPORT, 1, "n1"),  # another attempt's report
        ({}, 0, "n1"),
        (None, 0, "n1"),
        ([], 0, "n1"),  # none, or not one
    ],
)
def test_a_node_the_report_does_not_name_persistent_is_no_straggler(report, attempt, node):
    assert sp.straggler_reason(report, attempt, node) is None


def test_the_bench_record_has_the_contracts_fields():
    record = sp.benched_record(
        node_rank=1,
        node="n1",
        why=sp.HANG,
        reason="local rank 0 hung",
        time=NOW,
        job_id="7",
        attempt=2,
    )
    assert record.to_json() == {
        "node_rank": 1,
        "node": "n1",
        "why": "hang",
        "reason": "local rank 0 hung",
        "time": NOW,
        "job_id": "7",
        "attempt": 2,
    }


def test_the_round_says_which_node_stepped_out_and_why():
    lost = PeerLost(lost_node_rank=2, lost_node="n2")
    benched = Benched.model_validate(
        sp.benched_record(
            node_rank=1,
            node="n1",
            why=sp.HANG,
            reason="no heartbeat",
            time=NOW,
            job_id="7",
            attempt=0,
        )
    )
    assert (
        sp.swap_why({1: benched})
        == "node n1 stepped out (hang: no heartbeat): a spare takes its place"
    )
    assert sp.swap_why({2: lost, 1: benched}).startswith(
        "node n1 stepped out (hang: no heartbeat); node n2 lost"
    )
    assert sp.gone_name(3, PeerLost(lost_node_rank=3)) == "node rank 3"


def test_a_benched_active_node_is_swapped_like_a_lost_one(tmp_path):
    """The launchers read bench records beside loss reports: an active node's is a swap."""
    run = RunDir(tmp_path)
    run.recovery(0).mkdir(parents=True)
    (run.benched(0, 1)).write_text(
        json.dumps(
            sp.benched_record(
                node_rank=1, node="n1", why=sp.HANG, reason="r", time=NOW, job_id="7", attempt=0
            ).to_json()
        )
    )
    (run.peer_lost(0, 2)).write_text(json.dumps({"lost_node_rank": 2, "lost_node": "n2"}))
    gone = sp.gone_reports(run, 0)
    assert sorted(gone) == [1, 2] and gone[1].why == "hang"
    assert sp.loss_action(set(gone), {1: sp.ACTIVE}, 2) is sp.Action.SWAP
    assert sp.loss_action(set(gone), {1: sp.ACTIVE}, 1) is sp.Action.NEW_JOB


# ---------------------------------------------------------------- three launchers, one machine
# "checkpointing" too: the rank may be stopped inside a save, where the others wait for it.
HANG_TIMEOUTS = '{"step": 3, "compute": 3, "checkpointing": 5, "out_of_section": 3}'


def test_a_hung_node_steps_out_and_a_spare_replaces_it_in_the_same_run(tmp_path):
    """2 active + 1 spare, no in-job restart allowed: node 1's rank is stopped mid-training.
    Its launcher finds the hang, writes its bench record and leaves with exit 0; the batch
    host (its rank blocked on the stopped one) restarts with the spare from the last
    checkpoint, and the parameters end as an uninterrupted run's. The swap comes from the
    bench record, not from a peer-loss timeout."""
    steps = 150
    expected = reference_digest(tmp_path, steps)
    nodes = Launchers(
        tmp_path,
        nnodes=3,
        spare_nodes=1,
        steps=steps,
        launch_args=("--section-timeouts", HANG_TIMEOUTS),
    )
    try:
        nodes.wait_checkpoint(20)
        assert sp.read_lease(nodes.run, 0, 1).role == sp.ACTIVE, nodes.logs()
        os.kill(training_process(nodes.procs[1].pid), signal.SIGSTOP)
        codes = [p.wait(timeout=180) for p in nodes.procs]
        assert codes == [0, 0, 0], nodes.logs()
    finally:
        nodes.close()
    final = json.loads((nodes.ckpt / "final.json").read_text())
    assert final["step"] == steps and final["digest"] == expected  # bit for bit
    benched = json.loads(nodes.run.benched(0, 1).read_text())
    assert benched["why"] == "hang" and benched["node"] == "n1" and "hung" in benched["reason"]
    stepped = node_report(nodes.run, 1)
    assert stepped["outcome"] == "benched" and stepped["exit_code"] == 0
    assert stepped["benched"] == "hang" and len(stepped["hangs"]) == 1
    rounds = sorted(nodes.run.recovery(0).glob(ROUND_RECORDS))
    assert [p.name for p in rounds] == ["round-1.json"], nodes.logs()
    record = json.loads(rounds[0].read_text())
    assert record["lost"] == ["n1"] and record["world_size"] == 2 and record["spares_left"] == 0
    assert "n1 stepped out (hang" in record["why"], record
    survivor, took_over = node_report(nodes.run, 0), node_report(nodes.run, 2)
    assert survivor["spare_swaps"] == 1 and survivor["hangs"] == []  # its rank was blocked
    assert survivor["outcome"] == took_over["outcome"] == "finished"
    assert took_over["role"] == sp.ACTIVE
    assert not list(nodes.run.recovery(0).glob(PEER_LOST_REPORTS))  # no loss timeout


def test_of_two_non_batch_nodes_judging_a_hang_the_one_whose_rank_is_stopped_steps_out(
    tmp_path,
):
    """The race of two nodes other than the batch host, forced: 3 active nodes + 1 spare,
    node 1's rank stopped mid-training (a hang); node 2's rank, blocked in the all-reduce
    on it, is judged hung by its launcher first (a running timeout of 3 s against node 1's
    4 s). Before, node 2 stepped out (it judged first and may), and the hung node trained
    on. Now each says what it saw (`hang-claim-<n>.json`: node 1's rank frozen, node 2's
    running) and compares: node 1 steps out, node 2 waits for it, and the run ends with
    the spare as an uninterrupted one."""
    steps = 150
    expected = reference_digest(tmp_path, steps, world=3)
    slow = '{"step": 4, "compute": 4, "checkpointing": 5, "out_of_section": 4}'
    nodes = Launchers(
        tmp_path,
        nnodes=4,
        spare_nodes=1,
        steps=steps,
        launch_args=("--section-timeouts", slow),
        node_args={2: ("--section-timeouts", HANG_TIMEOUTS)},  # it judges first
    )
    try:
        nodes.wait_checkpoint(20)
        assert sp.read_lease(nodes.run, 0, 1).role == sp.ACTIVE, nodes.logs()
        os.kill(training_process(nodes.procs[1].pid), signal.SIGSTOP)
        codes = [p.wait(timeout=240) for p in nodes.procs]
        assert codes == [0, 0, 0, 0], nodes.logs()
    finally:
        nodes.close()
    final = json.loads((nodes.ckpt / "final.json").read_text())
    assert final["step"] == steps and final["digest"] == expected, nodes.logs()
    assert not nodes.run.benched(0, 2).exists(), nodes.logs()  # the healthy node stayed
    benched = json.loads(nodes.run.benched(0, 1).read_text())
    assert benched["why"] == "hang" and benched["node"] == "n1", benched
    claims = {r: json.loads(nodes.run.hang_claim(0, r).read_text()) for r in (1, 2)}
    assert claims[1]["evidence"] == "frozen" and claims[2]["evidence"] == "running", claims
    assert claims[2]["time"] < claims[1]["time"], claims  # node 2 judged first
    assert node_report(nodes.run, 1)["outcome"] == "benched"
    assert node_report(nodes.run, 2)["outcome"] == "finished"
    assert node_report(nodes.run, 3)["role"] == sp.ACTIVE  # the spare took node 1's place


def test_a_persistent_straggler_steps_out_and_a_spare_replaces_it(tmp_path):
    """Node 1 is made 4x slower from the start; with 1 s report windows, two of them make
    it persistent; its launcher steps out (why "straggler") and the spare trains on."""
    steps = 150
    expected = reference_digest(tmp_path, steps)
    nodes = Launchers(
        tmp_path,
        nnodes=3,
        spare_nodes=1,
        steps=steps,
        extra_env={
            "FTSLURM_INJECT": "straggler@0:n1*4",
            "FTSLURM_STRAGGLER_INTERVAL_S": "1",
            "FTSLURM_STRAGGLER_WINDOWS": "2",
        },
    )
    try:
        codes = [p.wait(timeout=240) for p in nodes.procs]
        assert codes == [0, 0, 0], nodes.logs()
    finally:
        nodes.close()
    final = json.loads((nodes.ckpt / "final.json").read_text())
    assert final["step"] == steps and final["digest"] == expected
    benched = json.loads(nodes.run.benched(0, 1).read_text())
    assert benched["why"] == "straggler" and "persistent straggler" in benched["reason"]
    assert node_report(nodes.run, 1)["outcome"] == "benched"
    record = json.loads(nodes.run.round_record(0, 1).read_text())
    assert record["lost"] == ["n1"] and "stepped out (straggler" in record["why"], record
    assert node_report(nodes.run, 2)["outcome"] == "finished"


# ---------------------------------------------------------------- the mock scheduler
def test_on_the_mock_a_hung_node_is_replaced_by_the_spare_in_the_same_job(tmp_path):
    """`--dry-run`: node rank 1's rank is stopped (SIGSTOP) at step 20; its launcher
    steps out, the spare takes over inside the same job, the daemon flags the node and
    records the swap, and training ends bit-identical."""
    run, record = spare_takes_over_on_the_mock(
        tmp_path,
        hang=True,
        settings=", section_timeouts={'step': 3.0, 'compute': 3.0, "
        "'checkpointing': 5.0}, out_of_section_timeout=3.0",
    )
    benched = list(run.recovery(0).glob("benched-*.json"))
    assert len(benched) == 1, list(run.recovery(0).iterdir())
    assert "stepped out (hang" in record["why"]
