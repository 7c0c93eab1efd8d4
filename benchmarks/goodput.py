"""Goodput of a month-long training job under four fault-tolerance policies, on the same
seeded failure traces, against two bounds.

For each job size (`--sizes`, nodes) one failure trace is drawn from `--seed` over `--days`
and replayed, unchanged, under each policy on the virtual-clock mock scheduler
(`ftslurm.backends.mock.virtual`), once per queue wait q (`--queue-wait`): the same Slurm
state machine decides placement, time limits, warning signals, the requeue delay and
node-failure detection; the policy decides what happens inside the allocation and after an
attempt ends. Reported per size, q and policy: ETTR (productive time / wall time), where the
rest of the wall time went, and the ETTR as a share of each bound.

    python benchmarks/goodput.py [--sizes 128,1024,2048] [--days 30] [--seed 1]
        [--failure-rate 3.79] [--lemon-share 0.714] [--straggler-rate 0.002]
        [--interval 1800] [--checkpoint-write 60] [--restart 300] [--queue-wait 0,600]
        [--plot goodput.png] [--json | --markdown]
    python benchmarks/goodput.py --calibrate [--days 30] [--seed 1]

The code keeps three things apart: the failure trace (`FailureModel`, `draw_trace`), the
policies (`JobSetup`, `Policy`, `policies`, `Campaign`, which replays a trace under one
policy) and the reporting (`simulate`, `bounds`, the tables). Every knob has a flag; the
defaults are the sourced constants below (q: 0 and 10 min, both reported).

Policies
  plain     `sbatch --requeue` with periodic checkpoints. Every early ending is requeued
            with Slurm's requeue delay: by Slurm itself after a node failure (NODE_FAIL,
            detected after SlurmdTimeout) or a preemption (PreemptMode=REQUEUE), by the
            batch script's `scontrol requeue` after a failed step or a wall-limit SIGTERM (the
            pattern of TorchX's template). No checkpoint on any signal; a hang waits for the
            NCCL watchdog; repaired nodes (lemons too) come back and are allocated again.
  submitit  submitit-style checkpoint-on-timeout: USR2 90 s before the wall limit and on
            preemption (PreemptParameters=send_user_signal assumed) it checkpoints and
            requeues itself (requeue delay applies). Its generated batch script has neither
            --requeue nor --no-requeue (submitit/slurm/slurm.py, `_make_sbatch_string`; the
            recorded script submitit/slurm/_sbatch_test_record.txt: `--signal=USR2@90`,
            `--wckey=submitit`, no requeue flag), so under Slurm's default JobRequeue=1 Slurm
            itself requeues it after a node failure or a preemption, as for plain requeue.
            A crash or a hang killed by the watchdog ends the job FAILED, which Slurm never
            requeues and submitit does not resubmit: a person does, after
            HUMAN_RESUBMIT_MEDIAN_S = 2 h median (assumed; log-normal, sigma 1, so a mean of
            3.3 h: nights and weekends), as a fresh job (no requeue delay; it waits q) that
            resumes from the last periodic checkpoint. (Until this review the model turned
            Slurm's requeue off for submitit, which cost it about 20 points at 2048 nodes.)
  nemo      NeMo-Run-style: `sbatch --requeue` plus the in-script `scontrol requeue` of its
            template, NVIDIA's ft_launcher with up to 3 in-job restarts per allocation for
            crashes and hangs, fixed heartbeat timeouts (rank 300 s, initial 1800 s: the
            FaultTolerancePlugin defaults), the PreemptionPlugin's TERM@60 checkpoint (its
            handler also outlives the limit's SIGTERM by KillWait: a 90 s lead). Node
            failures need a requeue (requeue delay); no node exclusion; stragglers are only
            logged. Its default budget: FaultTolerancePlugin num_job_retries_on_failure = 2
            (nemo/lightning/run/plugins.py; NeMo-Run's docs list the same default), which
            its Slurm template turns into "stop once the last 2 attempts in the
            job-results file all failed" (`is_job_failures_limit_reached` in
            ft_launcher.j2, a `tail -n $TORCHX_MAX_RETRIES` of that file).
  ftslurm   ftslurm with everything on (FtSettings with num_in_job_restarts=3,
            stop_if_straggler=True, budgets unlimited, the rest default): the daemon (polls on
            a 60 s grid) requeues at once with start-now (no requeue delay) and keeps the
            nodes it finds down after an ending (`policy.classify`/`decide`: a NODE_FAIL's,
            a node drained for maintenance) and persistent straggler nodes out of later
            attempts for node_exclusion_ttl_s (24 h, doubled for a node flagged again soon,
            up to node_exclusion_max_ttl_s, 7 d: `policy.flag_ttl`, `plan_exclusions`); the launcher
            restarts ranks in the job after a crash or a hang, with hang timeouts learned
            from earlier attempts (3 x the longest step seen, at least 30 s;
            `ftslurm.agent.launch.tightened`) plus its 0.5 s monitor interval; the
            checkpoint signal comes `checkpoint_lead(preempt_time=60, save=60 s)` = 125 s
            before the wall limit; a straggler node below the 0.75 score threshold for 3
            report windows of 60 s moves the job off it (requeue held, exclude, release: the
            work since the last checkpoint is lost, as a requeue's SIGTERM + KillWait 30 s
            leaves no time to save).
  Budgets. Every policy's retry budgets are unlimited: a month-long run at a 20 h wall limit
  needs ~36 continuations, and whoever plans one raises submitit's max_num_timeout=3,
  NeMo's num_job_retries_on_failure=2 and ftslurm's 2 (ftslurm gets the same treatment).
  For NeMo-Run the script also counts, in "default stop", how often its default (2 failed
  attempts in a row) would have stopped the run, each stop being one more resubmission by
  hand. Its template (src/nemo_run/core/execution/templates/ft_launcher.j2) writes "X" for
  an attempt when it starts and turns it into S or F in its teardown, so an attempt that
  ended FAILED (in-job restarts spent) and one killed before its teardown (a node failure
  or a preemption that Slurm requeues) both count as failed; only a clean checkpointed
  continuation (COMPLETED) resets the count.

The failure trace (per node of the pool: the job's nodes plus SPARE_FRACTION = 5% spares, at
least 2 (Bekman: 5-10%; NCSA Delta: 5%); a fault on a node outside the allocation only takes
that node away):
  FAILURES_PER_NODE_DAY = 3.79e-3    Llama 3 (arXiv 2407.21783, Table 5): 419 unexpected
      interruptions on 2048 nodes in 54 days; the fleet average, lemons included. By
      symptom: SHARE_CRASH = 56/419 (Llama 3: software bug, dependency; the process dies,
      the node is fine), SHARE_HANG = 0.135 (ByteRobust, SOSP'25: 5,948 of 44,184 failures
      were implicit, i.e. hangs and the like, against Llama 3's 7 NCCL-watchdog root causes:
      many hardware faults show up as hangs), both transient and on any node; the rest are
      hardware faults (GPU, memory, network, host) taken as node failures: the node's
      processes die at once, Slurm marks it down after SlurmdTimeout (300 s) and it is
      repaired in REPAIR_S = 4 h (OPT-175B: node replacement "took hours"; assumed 4 h).
  LEMON_FRACTION = 0.012, LEMON_SHARE = 10/14    Kokolis et al. (arXiv 2410.21680): lemon
      nodes were 1.2% of RSC-1 and removing them cut the failure rate of 512+-GPU jobs from
      14% to 4%, so they carried 10/14 of the (hardware) failures: a lemon fails 206 times
      as often as a healthy node (every ~6 days here), and a repair does not cure it.
  PLANNED_PER_NODE_DAY = 0.425e-3    Llama 3: 47 planned interruptions (automated
      maintenance) in the same 54 days; modelled as Slurm preemption with GraceTime
      PREEMPT_GRACE_S = 120 s (assumed: room for one 60 s save), the node drained for
      MAINTENANCE_S = 1 h (assumed).
  STRAGGLER_EPISODES_PER_NODE_DAY = 0.002, lasting log-uniform 30 s to 10 h (FALCON:
      fail-slows last tens of seconds to about 10 h), each slowing its node by a factor
      uniform in [1.1, 1.6] (MegaScale: ~10% slower hosts; FALCON: 1.34x average JCT
      stretch). The rate is a calibration (assumed): node-caused straggling should cost an
      unmanaged 2048-node job a few percent, below the 10.4% of GPU-hours the OSDI'25
      what-if study charges to all straggling (worker hardware dominates only 1.7% of it).
      A synchronous job runs at 1 / the largest slowdown among its nodes.

The job (the same for every policy):
  CHECKPOINT_INTERVAL_S = 1800, CHECKPOINT_COST_S = 60 (blocking)    Check-N-Run's 30 min
      default; a 60 s synchronous save (BLOOM: 40 s for 2.3 TB; 149 s for 7B sync DCP).
  RESTART_COST_S = 300    start-up plus checkpoint load at every start, in-job restarts
      included (Kokolis: u0 of 5-20 min typical; the low end).
  STEP_S = 10    training step time (assumed), from which ftslurm's hang timeout is learned.
  WALL_LIMIT_S = 20 h    typical HPC wall limit (Bekman, ml-engineering).
Slurm (mock defaults): SlurmdTimeout 300 s, requeue delay 120 s (cred_expire; BeginTime is
+121 s), KillWait 30 s, MinJobAge 300 s. PyTorch's NCCL watchdog: 600 s (10 min default).

Where the wall time goes (the categories add up to the wall time):
  productive  work computed and kept (the run in flight at the end counts in full)
  lost work   work computed, then lost to an interruption (redone later)
  startup     start-up and checkpoint loading, at every start and in-job restart
  checkpoint  blocking checkpoint writes, periodic and on a signal
  detection   nobody has acted yet: a dead node until Slurm notices, a crashed rank until
              the launcher sees it, an ended job until the daemon's next look
  hung        a hang until a watchdog or heartbeat timeout fires
  requeue     back in the queue: the requeue delay, then waiting for nodes
  human       a failed job waiting for a person to resubmit it (submitit)
  stragglers  running below full speed because a node of the allocation is slow

Queue wait q (`--queue-wait`, seconds, default 0 and 600): other jobs hold the nodes for q
after every requeue and resubmission, so the job cannot start before it went back to the
queue + q, whatever its BeginTime (a start-now included; Slurm's 121 s requeue delay runs
within q). It is charged to "requeue". An in-job restart does not leave the allocation and
pays no q.

The bounds per size and q, both Kokolis' queue-aware formula at the Young/Daly interval
dt* = sqrt(2 w / lam):
  E[ETTR] = (1 - lam (u0 + dt/2)) / ((1 + w/dt)(1 + lam_q q))
with w = the job's checkpoint write and lam_q = N x the trace's node-failure rate (only a
dead node needs a new allocation and so waits in the queue; crashes and hangs can be
restarted inside it). Zero detection and requeue latency; planned preemptions, wall
limits and stragglers free.
  today's   u0 = the job's restart cost (300 s), lam = N x the trace's rate of the failures
            a job on healthy nodes sees (crashes and hangs over the pool, node failures over
            its healthy nodes): lemons known in advance and never used.
  strict    u0 = 0, lam = N x the trace's rate of every failure in the pool, lemons
            included (lam_q: every node failure): nothing known in advance, restarts free.
At the published rates the strict bound is the lower one (lemons double lam at 2048
nodes, more than u0 costs); neither is above the other for every input. The script checks
and reports each policy against both.

Calibration (`--calibrate`): Kokolis et al., "Revisiting Reliability in Large-Scale Machine
Learning Research Clusters" (HPCA 2025, arXiv 2410.21680) estimate ETTR for a job of N
nodes from r_f failures per node-day, each costing a restart overhead u0 (from the failure
to training again: rescheduling, initialisation, checkpoint load), the work since the last
checkpoint (dt/2 on average) and a queue time q, with w per checkpoint:
E[ETTR] ~ (1 - N r_f (u0 + dt/2)) / ((1 + w/dt)(1 + N r_f q)). For RSC-1 (16k GPUs = 2048
nodes, r_f = 6.5 per 1000 node-days, u0 = 5 min, w = 0, q = 0) ETTR ~0.70 with a
checkpoint every 60 min and ~0.93 every 5 min. The script replays plain requeue under those
assumptions: every failure stops the job at once and is seen at once (a crash that the
batch script requeues: no hang, no SlurmdTimeout, no lemons, stragglers or maintenance),
requeue delay 0 (q = 0: no BeginTime either), u0 = 300 s at every start, no wall limit,
w = 0; failures strike at any time (also during a restart), as Poisson events over the
job's 2048 nodes. The lost work is what the job computed since its last checkpoint, not
dt/2 by assumption. It prints its ETTR beside the paper's figure, the first-order formula
and the exact expectation of the same model (renewal: dt lam / (e^(lam u0)(e^(lam dt) -
1)) = 0.714 and 0.933; the first-order formula drops the higher terms and gives 0.676 at
60 min), and exits 1 if a figure is more than 0.03 from the paper's.

Cost: the simulation is single-threaded; the default three sizes under two queue waits and
all four policies (24 simulations) take about 22 s of one core, `--calibrate` about 2 s.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ftslurm.agent.heartbeat import Timeouts
from ftslurm.agent.launch import parse_args as launcher_args
from ftslurm.agent.launch import tightened
from ftslurm.backends.mock import model
from ftslurm.backends.mock.model import MockConfig, MockNodeSpec, NodeStatus
from ftslurm.backends.mock.virtual import JobModel, RunBreakdown, VirtualCluster
from ftslurm.core.types import JobOptions, JobState
from ftslurm.daemon import policy as ftpolicy

DAY = 86400.0
HOUR = 3600.0

# ---------------------------------------------------------------- the failure trace
# Llama 3 (arXiv 2407.21783, Table 5): 419 unexpected interruptions, 2048 nodes, 54 days.
FAILURES_PER_NODE_DAY = 419 / (2048 * 54)  # 3.79e-3, the fleet average (lemons included)
SHARE_CRASH = 56 / 419  # Llama 3: software bug 54 + dependency 2 (the node is fine)
SHARE_HANG = 5948 / (38236 + 5948)  # ByteRobust: implicit failures (hangs), by symptom
SHARE_NODE = 1 - SHARE_CRASH - SHARE_HANG  # hardware (GPU, memory, network, host)
# Kokolis et al. (arXiv 2410.21680): lemons were 1.2% of RSC-1 nodes; removing them cut
# the failure rate of 512+-GPU jobs from 14% to 4%: they carried 10/14 of the failures.
LEMON_FRACTION = 0.012
LEMON_SHARE = 10 / 14  # of the hardware failures
HEALTHY_NODE_FAILURES_PER_NODE_DAY = (FAILURES_PER_NODE_DAY * SHARE_NODE * (1 - LEMON_SHARE)
                                      / (1 - LEMON_FRACTION))  # fmt: skip
LEMON_NODE_FAILURES_PER_NODE_DAY = (FAILURES_PER_NODE_DAY * SHARE_NODE * LEMON_SHARE
                                    / LEMON_FRACTION)  # fmt: skip  # 206x: every ~6 days
REPAIR_S = 4 * HOUR  # OPT-175B logbook: cloud node replacement "took hours" (assumed 4 h)
# Llama 3: 47 planned interruptions (automated maintenance) in the same 54 days.
PLANNED_PER_NODE_DAY = 47 / (2048 * 54)  # 0.425e-3
PREEMPT_GRACE_S = 120.0  # partition GraceTime (assumed; Slurm's default 0 allows no save)
MAINTENANCE_S = 1 * HOUR  # a node drained for maintenance comes back after (assumed)
# Fail-slow episodes: FALCON (tens of seconds to ~10 h; 1.34x average JCT stretch),
# MegaScale (~10% slower hosts). The rate is a calibration (assumed, see the docstring).
STRAGGLER_EPISODES_PER_NODE_DAY = 0.002
STRAGGLER_DURATION_S = (30.0, 10 * HOUR)  # log-uniform
STRAGGLER_SLOWDOWN = (1.1, 1.6)  # uniform
SPARE_FRACTION = 0.05  # spare nodes in the pool (Bekman: 5-10%; NCSA Delta: 5%)

# ------------------------------------------------------------------------ the job
CHECKPOINT_INTERVAL_S = 1800.0  # Check-N-Run's 30 min default (RSC assumes 1 h)
CHECKPOINT_COST_S = 60.0  # blocking save (BLOOM 40 s for 2.3 TB; 7B sync DCP 149 s)
RESTART_COST_S = 300.0  # start-up + checkpoint load, every start (Kokolis: u0 5-20 min)
STEP_S = 10.0  # training step (assumed); ftslurm learns its hang timeout from it
WALL_LIMIT_S = 20 * HOUR  # typical HPC wall limit (Bekman, ml-engineering)

# ---------------------------------------------------------------------- Slurm (mock)
SLURMD_TIMEOUT_S = 300  # SlurmdTimeout default
REQUEUE_DELAY_S = 120  # requeue_delay = cred_expire default (BeginTime = now + 121 s)
KILL_WAIT_S = 30  # KillWait default
MIN_JOB_AGE_S = 300  # MinJobAge default

# ---------------------------------------------------------------------- the policies
NCCL_WATCHDOG_S = 600.0  # ProcessGroupNCCL timeout, 10 min default since PyTorch PR #110947
SUBMITIT_SIGNAL_DELAY_S = 90  # submitit: --signal=USR2@90 (signal_delay_s default)
HUMAN_RESUBMIT_MEDIAN_S = 2 * HOUR  # a person notices and resubmits (assumed), log-normal
HUMAN_RESUBMIT_SIGMA = 1.0  # spread of that delay (nights, weekends): mean ~3.3 h
NEMO_RANK_HEARTBEAT_S = 300.0  # NeMo-Run FaultTolerancePlugin rank_heartbeat_timeout
NEMO_INITIAL_HEARTBEAT_S = 1800.0  # ... initial_rank_heartbeat_timeout (to the 1st beat)
NVRX_CHECK_INTERVAL_S = 5.0  # NVRx workload_check_interval
NVRX_MONITOR_S = 0.3  # ft_launcher --monitor-interval
NEMO_IN_JOB_RESTARTS = 3  # FaultTolerancePlugin num_in_job_restarts
NEMO_JOB_RETRIES_ON_FAILURE = 2  # ... num_job_retries_on_failure: stop after 2 failed in a row
# PreemptionPlugin preempt_time 60 s gives TERM@60; its handler survives the SIGTERM at the
# limit for KillWait more. The mock treats SIGTERM as a kill, so it is modelled as USR2@90.
NEMO_SIGNAL_LEAD_S = 60 + KILL_WAIT_S
FTSLURM = ftpolicy.FtSettings(num_in_job_restarts=NEMO_IN_JOB_RESTARTS, stop_if_straggler=True,
                              num_job_retries_on_failure=10**9)  # fmt: skip
_LAUNCHER = launcher_args(["--", "train"])  # the launcher's defaults
FTSLURM_MONITOR_S = _LAUNCHER.monitor_interval  # 0.5 s
FTSLURM_SETUP_TIMEOUT_S = 600.0  # configured "setup" section timeout (never tightened)
FTSLURM_HANG_TIMEOUT_S = tightened(Timeouts(sections={"setup": FTSLURM_SETUP_TIMEOUT_S,
                                                      "step": 180.0}, out_of_section=300.0),
                                   [{"step": STEP_S}], _LAUNCHER.safety_factor
                                   ).sections["step"]  # fmt: skip  # max(30, 3 x 10 s)
FTSLURM_SIGNAL_LEAD_S, _ = ftpolicy.checkpoint_lead(FTSLURM.preempt_time, CHECKPOINT_COST_S)
# (at the default w; `policies(setup)` computes it for the setup's w)
DAEMON_POLL_S = 60.0  # the daemon looks at least this often (next_poll_interval's ceiling)
DAEMON_FAST_POLL_S = 1.0  # ... and this soon after its own action (its floor)

CAUSES = ("lost_work", "startup", "checkpoint", "detection", "hung", "requeue", "human",
          "stragglers")  # fmt: skip
CAUSE_LABELS = {"lost_work": "lost work", "startup": "startup", "checkpoint": "checkpoint",
                "detection": "detection", "hung": "hung", "requeue": "requeue",
                "human": "human", "stragglers": "stragglers"}  # fmt: skip


# ------------------------------------------------------------ the knobs (command line)
@dataclass(frozen=True)
class FailureModel:
    """What goes wrong, per node (the trace's rates). The defaults are the sourced constants
    above; `--failure-rate`, `--lemon-share` and `--straggler-rate` change them."""

    failures_per_node_day: float = FAILURES_PER_NODE_DAY  # fleet average, lemons included
    share_crash: float = SHARE_CRASH
    share_hang: float = SHARE_HANG
    lemon_fraction: float = LEMON_FRACTION
    lemon_share: float = LEMON_SHARE  # of the hardware (node) failures
    planned_per_node_day: float = PLANNED_PER_NODE_DAY
    straggler_episodes_per_node_day: float = STRAGGLER_EPISODES_PER_NODE_DAY
    spare_fraction: float = SPARE_FRACTION

    @property
    def share_node(self) -> float:
        return max(0.0, 1 - self.share_crash - self.share_hang)

    @property
    def _lemon_share(self) -> float:
        return self.lemon_share if self.lemon_fraction > 0 else 0.0

    @property
    def healthy_node_failures_per_node_day(self) -> float:
        return (self.failures_per_node_day * self.share_node * (1 - self._lemon_share)
                / (1 - self.lemon_fraction))  # fmt: skip

    @property
    def lemon_node_failures_per_node_day(self) -> float:
        if self.lemon_fraction <= 0:
            return 0.0
        share = self.share_node * self._lemon_share
        return self.failures_per_node_day * share / self.lemon_fraction


@dataclass(frozen=True)
class JobSetup:
    """The job and the scheduler around it, the same for every policy. The defaults are the
    sourced constants above; `--interval`, `--checkpoint-write`, `--restart` and
    `--queue-wait` change them."""

    checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S
    checkpoint_cost_s: float = CHECKPOINT_COST_S  # w
    restart_cost_s: float = RESTART_COST_S  # u0
    queue_wait_s: float = 0.0  # q: other jobs hold the nodes this long after each requeue
    wall_limit_s: float | None = WALL_LIMIT_S  # None: no wall limit
    requeue_delay_s: int = REQUEUE_DELAY_S
    slurmd_timeout_s: int = SLURMD_TIMEOUT_S


# ------------------------------------------------------------------- the bounds (pure)
def young_daly_interval(checkpoint_cost_s: float, failure_rate_per_s: float) -> float:
    """Young's (and Kokolis') optimal checkpoint interval sqrt(2 w / lam); inf without
    failures."""
    if failure_rate_per_s <= 0:
        return math.inf
    return math.sqrt(2 * max(0.0, checkpoint_cost_s) / failure_rate_per_s)


def kokolis_ettr(failure_rate_per_s: float, restart_s: float, interval_s: float,
                 checkpoint_cost_s: float = 0.0, queue_s: float = 0.0,
                 queued_rate_per_s: float | None = None) -> float:  # fmt: skip
    """E[ETTR] ~ (1 - lam (u0 + dt/2)) / ((1 + w/dt)(1 + lam_q q)) (Kokolis et al., with the
    queue time per failure q), clamped at 0. lam_q is the rate of the failures that send
    the job back to the queue (default: all of them). An infinite interval never
    checkpoints."""
    lam = failure_rate_per_s
    lam_q = lam if queued_rate_per_s is None else queued_rate_per_s
    if interval_s <= 0:
        raise ValueError("the checkpoint interval must be positive")
    if math.isinf(interval_s):
        return 1.0 if lam <= 0 else 0.0
    lost = lam * (restart_s + interval_s / 2)
    return max(0.0, (1 - lost) / ((1 + checkpoint_cost_s / interval_s) * (1 + lam_q * queue_s)))


def renewal_ettr(failure_rate_per_s: float, restart_s: float, interval_s: float) -> float:
    """The exact ETTR of the same model with w = 0 and q = 0: Poisson failures strike at any
    time, also during a restart; each costs the work since the last checkpoint and a
    restart of u0. Completing an interval takes E[T] = e^(lam u0) (e^(lam dt) - 1) / lam of
    wall time, so ETTR = dt / E[T]. Kokolis' formula is its first-order expansion."""
    lam = failure_rate_per_s
    if lam <= 0:
        return 1.0
    return interval_s * lam / (math.exp(lam * restart_s) * math.expm1(lam * interval_s))


def ideal_bound(nodes: int, failures_per_node_day: float, restart_s: float,
                checkpoint_cost_s: float, queue_s: float = 0.0,
                queued_per_node_day: float = 0.0) -> dict[str, float]:  # fmt: skip
    """Kokolis' formula at the Young/Daly interval for lam = nodes x failures_per_node_day,
    with q charged to the failures that need a new allocation (queued_per_node_day)."""
    lam = nodes * failures_per_node_day / DAY
    lam_q = nodes * queued_per_node_day / DAY
    dt = young_daly_interval(checkpoint_cost_s, lam)
    if lam <= 0:
        ettr = 1.0
    elif dt == 0:
        ettr = max(0.0, 1 - lam * restart_s) / (1 + lam_q * queue_s)
    else:
        ettr = kokolis_ettr(lam, restart_s, dt, checkpoint_cost_s, queue_s, lam_q)
    return {"ettr": ettr, "failures_per_day": lam * DAY,
            "mttf_h": math.inf if lam <= 0 else 1 / lam / HOUR,
            "interval_s": dt, "restart_s": restart_s, "checkpoint_cost_s": checkpoint_cost_s,
            "queue_s": queue_s, "queued_failures_per_day": lam_q * DAY}  # fmt: skip


def bounds(trace: Trace, setup: JobSetup) -> dict[str, dict[str, float]]:
    """Both bounds for a trace: today's (u0 = the job's restart cost, lemons known in
    advance and never used: lam over the failures a job on healthy nodes sees) and the
    strict one (u0 = 0, lam over every failure in the fleet, lemons included). Each at the
    Young/Daly interval, with q charged per node failure (a crash or hang can be restarted
    in the allocation, a dead node cannot)."""
    q = setup.queue_wait_s
    today = ideal_bound(trace.nodes, trace.ordinary_failures_per_node_day(),
                        setup.restart_cost_s, setup.checkpoint_cost_s, q,
                        trace.node_failures_per_node_day(lemons=False))  # fmt: skip
    strict = ideal_bound(trace.nodes, trace.fleet_failures_per_node_day(), 0.0,
                         setup.checkpoint_cost_s, q,
                         trace.node_failures_per_node_day(lemons=True))  # fmt: skip
    return {"today": today, "strict": strict}


# ---------------------------------------------------------------------- the trace
@dataclass(frozen=True)
class Fault:
    at: float
    kind: str  # node | crash | hang | straggler | maintenance
    node: str
    lemon: bool = False  # a lemon's extra hardware failure
    duration_s: float = 0.0  # straggler
    slowdown: float = 1.0  # straggler


FAILURE_KINDS = ("node", "crash", "hang")  # what interrupts a job (counted in lam)


@dataclass(frozen=True)
class Trace:
    nodes: int
    days: float
    pool: tuple[str, ...]
    lemons: frozenset[str]
    faults: tuple[Fault, ...]
    human_delays_s: tuple[float, ...]
    model: FailureModel = FailureModel()

    @property
    def horizon_s(self) -> float:
        return self.days * DAY

    def _per_node_day(self, count: int, nodes: int) -> float:
        return count / max(1, nodes) / self.days if self.days > 0 else 0.0

    def ordinary_failures_per_node_day(self) -> float:
        """The trace's own rate of the failures a job on healthy nodes sees: crashes and
        hangs over the pool, node failures over its healthy nodes."""
        anywhere = sum(1 for f in self.faults if f.kind in ("crash", "hang"))
        return (self._per_node_day(anywhere, len(self.pool))
                + self.node_failures_per_node_day(lemons=False))  # fmt: skip

    def node_failures_per_node_day(self, lemons: bool) -> float:
        """The trace's rate of node failures: over its healthy nodes (lemons=False) or over
        the whole pool, lemons' failures included."""
        if lemons:
            return self._per_node_day(sum(1 for f in self.faults if f.kind == "node"),
                                      len(self.pool))  # fmt: skip
        healthy = sum(1 for f in self.faults if f.kind == "node" and not f.lemon)
        return self._per_node_day(healthy, len(self.pool) - len(self.lemons))

    def fleet_failures_per_node_day(self) -> float:
        """Every failure in the pool (lemons included) per node-day."""
        return self._per_node_day(sum(1 for f in self.faults if f.kind in FAILURE_KINDS),
                                  len(self.pool))  # fmt: skip

    def facts(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for f in self.faults:
            key = "lemon_node" if f.lemon else f.kind
            counts[key] = counts.get(key, 0) + 1
        return {"nodes": self.nodes, "pool_nodes": len(self.pool),
                "spare_nodes": len(self.pool) - self.nodes, "lemon_nodes": len(self.lemons),
                "days": self.days, "faults_in_pool": counts,
                "ordinary_failures_per_1000_node_days":
                    1000 * self.ordinary_failures_per_node_day(),
                "trace_fleet_failures_per_1000_node_days":
                    1000 * self.fleet_failures_per_node_day(),
                "fleet_failures_per_1000_node_days": 1000 * self.model.failures_per_node_day,
                "lemon_failures_per_1000_node_days":
                    1000 * self.model.lemon_node_failures_per_node_day}  # fmt: skip


def draw_trace(seed: int, nodes: int, days: float, fm: FailureModel = FailureModel()) -> Trace:
    """Everything that will go wrong, per node of the pool, over `days` (deterministic)."""
    rng = random.Random(f"goodput/{seed}/{nodes}/{float(days)!r}")
    pool = tuple(f"n{i}" for i in range(1, nodes + max(2, round(nodes * fm.spare_fraction)) + 1))
    lemons = frozenset(rng.sample(pool, round(len(pool) * fm.lemon_fraction)))
    horizon = days * DAY
    faults: list[Fault] = []

    def poisson(per_node_day: float, among: tuple[str, ...],
                make: Callable[[float, str], Fault]) -> None:  # fmt: skip
        rate = per_node_day * len(among) / DAY
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= horizon:
                return
            faults.append(make(t, rng.choice(among)))

    healthy = tuple(n for n in pool if n not in lemons)
    poisson(fm.failures_per_node_day * fm.share_crash, pool, lambda t, n: Fault(t, "crash", n))
    poisson(fm.failures_per_node_day * fm.share_hang, pool, lambda t, n: Fault(t, "hang", n))
    poisson(fm.healthy_node_failures_per_node_day, healthy, lambda t, n: Fault(t, "node", n))
    poisson(fm.lemon_node_failures_per_node_day, tuple(sorted(lemons)),
            lambda t, n: Fault(t, "node", n, lemon=True))  # fmt: skip
    poisson(fm.planned_per_node_day, pool, lambda t, n: Fault(t, "maintenance", n))
    lo, hi = STRAGGLER_DURATION_S
    poisson(fm.straggler_episodes_per_node_day, pool, lambda t, n: Fault(
        t, "straggler", n, duration_s=math.exp(rng.uniform(math.log(lo), math.log(hi))),
        slowdown=rng.uniform(*STRAGGLER_SLOWDOWN)))  # fmt: skip
    faults.sort(key=lambda f: (f.at, f.kind, f.node))
    human = tuple(rng.lognormvariate(math.log(HUMAN_RESUBMIT_MEDIAN_S), HUMAN_RESUBMIT_SIGMA)
                  for _ in range(4096))  # fmt: skip
    return Trace(nodes, days, pool, lemons, tuple(faults), human, fm)


# ---------------------------------------------------------------------- the policies
@dataclass(frozen=True)
class Policy:
    key: str
    label: str
    requeue: bool | None  # sbatch --requeue (None: neither flag, JobRequeue decides)
    auto_continue: bool  # a failed attempt is continued without a person
    signal_lead_s: float | None  # checkpoint signal this long before the wall limit
    save_on_preempt: bool
    hang_timeout_s: float  # from the hang to the kill or in-job restart
    startup_hang_timeout_s: float  # same, for a hang during start-up
    in_job_restarts: int  # per allocation
    crash_detect_s: float  # an in-job launcher sees a dead rank after this
    daemon: bool  # ftslurm: start now, node exclusion, straggler moves
    # the tool's default stop after this many consecutive failed attempts; the simulated
    # budget is unlimited, and the campaign counts how often this default would have stopped
    default_failure_budget: int | None = None


def policies(setup: JobSetup = JobSetup()) -> tuple[Policy, ...]:
    """The four policies for a job setup (ftslurm's checkpoint signal lead follows w)."""
    ftslurm_lead, _ = ftpolicy.checkpoint_lead(FTSLURM.preempt_time, setup.checkpoint_cost_s)
    return (
        Policy("plain", "plain requeue", requeue=True, auto_continue=True, signal_lead_s=None,
               save_on_preempt=False, hang_timeout_s=NCCL_WATCHDOG_S,
               startup_hang_timeout_s=NCCL_WATCHDOG_S, in_job_restarts=0, crash_detect_s=0.0,
               daemon=False),
        # requeue=None: submitit's sbatch header has neither --requeue nor --no-requeue, so
        # Slurm's JobRequeue=1 default requeues it after a node failure or a preemption
        Policy("submitit", "submitit", requeue=None, auto_continue=False,
               signal_lead_s=SUBMITIT_SIGNAL_DELAY_S, save_on_preempt=True,
               hang_timeout_s=NCCL_WATCHDOG_S, startup_hang_timeout_s=NCCL_WATCHDOG_S,
               in_job_restarts=0, crash_detect_s=0.0, daemon=False),
        Policy("nemo", "NeMo-Run", requeue=True, auto_continue=True,
               signal_lead_s=NEMO_SIGNAL_LEAD_S, save_on_preempt=True,
               hang_timeout_s=NEMO_RANK_HEARTBEAT_S + NVRX_CHECK_INTERVAL_S,
               startup_hang_timeout_s=NEMO_INITIAL_HEARTBEAT_S + NVRX_CHECK_INTERVAL_S,
               in_job_restarts=NEMO_IN_JOB_RESTARTS, crash_detect_s=NVRX_MONITOR_S,
               daemon=False, default_failure_budget=NEMO_JOB_RETRIES_ON_FAILURE),
        Policy("ftslurm", "ftslurm", requeue=True, auto_continue=True,
               signal_lead_s=ftslurm_lead, save_on_preempt=True,
               hang_timeout_s=FTSLURM_HANG_TIMEOUT_S + FTSLURM_MONITOR_S,
               startup_hang_timeout_s=FTSLURM_SETUP_TIMEOUT_S + FTSLURM_MONITOR_S,
               in_job_restarts=FTSLURM.num_in_job_restarts, crash_detect_s=FTSLURM_MONITOR_S,
               daemon=True),
    )  # fmt: skip


POLICIES = policies()


@dataclass
class Result:
    wall_s: float = 0.0
    productive_s: float = 0.0
    lost_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s else 0.0


class Campaign:
    """One policy replaying one trace on a fresh virtual cluster."""

    def __init__(self, trace: Trace, pol: Policy, setup: JobSetup = JobSetup()) -> None:
        self.trace, self.pol, self.setup = trace, pol, setup
        cfg = MockConfig(nodes=[MockNodeSpec(name=n, cpus=1) for n in trace.pool],
                         requeue_delay_s=setup.requeue_delay_s,
                         slurmd_timeout_s=setup.slurmd_timeout_s,
                         kill_wait_s=KILL_WAIT_S, min_job_age_s=MIN_JOB_AGE_S)  # fmt: skip
        self.c = VirtualCluster(cfg, queue_wait_s=setup.queue_wait_s)
        self.job = JobModel(work_s=10 * trace.horizon_s + DAY,
                            checkpoint_interval_s=setup.checkpoint_interval_s,
                            checkpoint_cost_s=setup.checkpoint_cost_s,
                            restart_cost_s=setup.restart_cost_s)  # fmt: skip
        lead = None if pol.signal_lead_s is None else f"USR2@{int(round(pol.signal_lead_s))}"
        limit = None if setup.wall_limit_s is None else f"0:{int(setup.wall_limit_s)}"
        self.options = JobOptions(nodes=trace.nodes, time_limit=limit, requeue=pol.requeue,
                                  signal=lead)  # fmt: skip
        self.r = Result()
        self.failed_in_row = 0  # consecutive failed attempts (for default_failure_budget)
        self.attempt_ended = False  # the current attempt's batch script saw its end
        self.humans = 0  # resubmissions by hand so far
        # the current run and allocation
        self.alloc: list[str] = []
        self.alloc_serial = 0
        self.alloc_saved = 0.0
        self.run_serial = 0
        self.run_start = 0.0
        self.restarts_left = 0
        self.in_job = False  # the next start is an in-job restart
        self.stall: str | None = None  # why the current run is stalled (hung, detection)
        self.last_end = 0.0  # when the last run ended
        self.ended_at: float | None = None  # when the job became terminal (human path)
        self.resubmit_at: float | None = None  # when a person resubmits it
        self.carry: float | None = None  # work left while the job is out of the controller
        # node state seen by the policy
        self.slow: dict[str, list[float]] = {}  # node -> slowdowns of its current episodes
        self.flags: dict[str, tuple[float, float]] = {}  # ftslurm: node -> (since, expires)
        self.budget = ftpolicy.Budget()
        self.looks: set[float] = set()  # times of the daemon's scheduled looks
        self.seen_restarts = 0  # the job's restart count the daemon has seen
        self.moved = False  # the daemon itself requeued the job (off a straggler)
        self.c.on_start = self._on_start
        self.c.on_run_end = self._on_run_end
        self.c.on_end = self._on_end
        self.jid = self.c.submit(self.options, self.job)

    # ------------------------------------------------------------------ driving
    def run(self) -> Result:
        for f in self.trace.faults:
            self.c.at(f.at, lambda f=f: self._fault(f))
        horizon = self.trace.horizon_s
        self.c.run(horizon)
        self.c.now = horizon
        self._finish(horizon)
        self.r.wall_s = horizon
        return self.r

    def _finish(self, now: float) -> None:
        """Account the end of the horizon: the run in flight, or the gap since the last."""
        b = self.c.breakdown(self.jid)
        if b is not None:
            self._account(b, in_flight=True)
            return
        job = self.c.st.jobs.get(self.jid)
        if self.resubmit_at is not None and self.ended_at is not None:
            self._add("detection", self.ended_at - self.last_end)
            self._add("human", min(now, self.resubmit_at) - self.ended_at)
            self._add("requeue", now - self.resubmit_at)
        elif job is not None and job.state is JobState.PENDING:
            back = min(max(job.submit_time, self.last_end), now)
            self._add("detection", back - self.last_end)
            self._add("requeue", now - back)
        else:
            self._add("detection", now - self.last_end)

    def _add(self, cause: str, seconds: float) -> None:
        self.r.lost_s[cause] += max(0.0, seconds)

    def _account(self, b: RunBreakdown, in_flight: bool = False) -> None:
        r = self.r
        r.productive_s += b.computed_s if in_flight else b.saved_s
        self._add("lost_work", 0.0 if in_flight else b.computed_s - b.saved_s)
        self._add("startup", b.startup_s)
        self._add("checkpoint", b.checkpoint_s)
        self._add("stragglers", b.slow_s)
        self._add(self.stall or "hung", b.stalled_s)

    # -------------------------------------------------------------- cluster hooks
    def _on_start(self, jid: str) -> None:
        now = self.c.now
        self.run_serial += 1
        self.run_start = now
        self.stall = None
        if self.in_job:
            self.in_job = False
        else:
            self._gap(jid, now)
            if self.alloc_serial > 0 and not self.attempt_ended:
                self._attempt_result(ok=False)  # killed and requeued by Slurm itself
            self.attempt_ended = False
            self.alloc = list(self.c.st.jobs[jid].nodes)
            self.alloc_serial += 1
            self.alloc_saved = 0.0
            self.restarts_left = self.pol.in_job_restarts
            self.r.count("allocations")
            if self.pol.daemon:
                for node in self.alloc:
                    if self.slow.get(node):
                        self._watch_straggler(node, now)
        self._speed()

    def _gap(self, jid: str, now: float) -> None:
        """Account the time from the last run's end to this start."""
        if self.resubmit_at is not None and self.ended_at is not None:
            self._add("detection", self.ended_at - self.last_end)
            self._add("human", self.resubmit_at - self.ended_at)
            self._add("requeue", now - self.resubmit_at)
            self.resubmit_at = self.ended_at = None
            return
        back = min(max(self.c.st.jobs[jid].submit_time, self.last_end), now)
        self._add("detection", back - self.last_end)
        self._add("requeue", now - back)

    def _on_run_end(self, b: RunBreakdown) -> None:
        self._account(b)
        self.alloc_saved += b.saved_s
        self.last_end = b.ended
        self.stall = None

    def _on_end(self, jid: str, state: JobState) -> None:
        """The job ended (terminal): continue it as the policy does."""
        if jid != self.jid:
            return
        self.carry = self.c.remaining.pop(jid)
        now = self.c.now
        self.r.count(f"ended_{state.value.lower()}")
        if state in (JobState.COMPLETED, JobState.TIMEOUT):
            self.r.count("wall_limits")  # a continuation (checkpointed) or a wall-limit kill
        self.attempt_ended = True
        self._attempt_result(ok=state is JobState.COMPLETED)
        if self.pol.daemon:
            self._arm(now)
        elif state in (JobState.COMPLETED, JobState.TIMEOUT, JobState.PREEMPTED) or (
                self.pol.auto_continue):  # fmt: skip
            self._slurm_requeue(jid)  # the batch script's / signal handler's requeue
        else:
            self.ended_at = now
            delays = self.trace.human_delays_s
            self.resubmit_at = now + delays[self.humans % len(delays)]
            self.humans += 1
            self.r.count("human_resubmits")
            self.c.at(self.resubmit_at, self._resubmit)

    def _attempt_result(self, ok: bool) -> None:
        """NeMo-Run's job-results file: an attempt writes "X" when it starts and turns it
        into S (every step succeeded) or F in its teardown; one killed before the teardown
        (a node failure, Slurm's requeue) keeps its X. The default stops the run once the
        last `default_failure_budget` lines are all X or F (counted, the run goes on)."""
        self.failed_in_row = 0 if ok else self.failed_in_row + 1
        if self.failed_in_row == self.pol.default_failure_budget:
            self.r.count("over_default_budget")
            self.failed_in_row = 0

    def _slurm_requeue(self, jid: str) -> None:
        job = self.c.st.jobs[jid]
        allowed, job.requeue_allowed = job.requeue_allowed, True  # its own scontrol requeue
        model.requeue(self.c.st, jid, False, self.c.now)
        job.requeue_allowed = allowed
        self.c.remaining[jid] = self.carry if self.carry is not None else 0.0
        self.carry = None
        self.r.count("requeues")

    def _resubmit(self) -> None:
        """A person submits the job again (a fresh job: no requeue delay)."""
        self.jid = self.c.submit(self.options, self.job, queue_wait_s=self.setup.queue_wait_s)
        self.c.remaining[self.jid] = self.carry if self.carry is not None else 0.0
        self.carry = None

    # ----------------------------------------------------------------- the faults
    def _running(self, node: str | None = None) -> bool:
        """Whether the job has a live run (on `node`, when given) that a fault can hit."""
        job = self.c.st.jobs.get(self.jid)
        run = self.c.runs.get(self.jid)
        return (job is not None and job.state is JobState.RUNNING and run is not None
                and run.saved_on_exit is None and (node is None or node in job.nodes))

    def _fault(self, f: Fault) -> None:
        st, now = self.c.st, self.c.now
        n = st.nodes[f.node]
        usable = n.status is NodeStatus.UP and n.dead_since is None
        job = st.jobs.get(self.jid)
        on_job = job is not None and f.node in job.nodes and job.state in (
            JobState.RUNNING, JobState.COMPLETING)  # fmt: skip
        if f.kind == "straggler":
            self.slow.setdefault(f.node, []).append(f.slowdown)
            self.c.at(now + f.duration_s, lambda: self._straggler_over(f))
            if on_job:
                self._speed()
                if self.pol.daemon:
                    self._watch_straggler(f.node, now)
            return
        if f.kind in ("node", "maintenance") and not usable:
            return  # already out of service
        if f.kind == "node":
            if on_job and self.jid in self.c.runs:
                self.r.count("hit_lemon" if f.lemon else "hit_node_failure")
            self.c.fail_node(f.node)
            self.c.at(now + REPAIR_S, lambda: model.revive_node(st, f.node))
            if on_job and self.pol.daemon:
                self._arm(now + self.setup.slurmd_timeout_s)
            return
        if f.kind == "maintenance":
            if on_job and job is not None and job.state is JobState.RUNNING:
                self.r.count("hit_preemption")
                self.c.preempt(self.jid, PREEMPT_GRACE_S, self.pol.save_on_preempt)
                if self.pol.daemon:
                    self._arm(now)
            model.drain_node(st, f.node, "maintenance")
            self.c.at(now + MAINTENANCE_S, lambda: model.revive_node(st, f.node))
            return
        if not self._running(f.node) or self.stall is not None:
            return
        self.r.count(f"hit_{f.kind}")
        if f.kind == "crash":
            if self.restarts_left > 0:
                self._stall("detection")
                self._later(self.pol.crash_detect_s, self._recover)
            else:
                self.c.end_processes(self.jid, 1)  # srun --kill-on-bad-exit: step fails
        elif f.kind == "hang":
            self._stall("hung")
            startup = now - self.run_start < self.setup.restart_cost_s
            wait = self.pol.startup_hang_timeout_s if startup else self.pol.hang_timeout_s
            self._later(wait, self._recover)

    def _stall(self, why: str) -> None:
        self.stall = why
        self.c.set_speed(self.jid, 0.0)

    def _later(self, delay: float, action: Callable[[], None]) -> None:
        """Run `action` after `delay` if the current run is still the same then."""
        serial = self.run_serial
        self.c.at(self.c.now + delay, lambda: action() if serial == self.run_serial
                  and self.jid in self.c.runs else None)  # fmt: skip

    def _recover(self) -> None:
        """The launcher (or the watchdog) acts on a dead or hung rank."""
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self.r.count("in_job_restarts")
            self.in_job = True
            self.c.restart_in_job(self.jid, self.setup.restart_cost_s)
        else:
            self.c.end_processes(self.jid, 1)

    def _speed(self) -> None:
        if self.stall is not None or self.jid not in self.c.runs:
            return
        job = self.c.st.jobs[self.jid]
        worst = max((max(self.slow[n]) for n in job.nodes if self.slow.get(n)), default=1.0)
        self.c.set_speed(self.jid, 1.0 / worst)

    def _straggler_over(self, f: Fault) -> None:
        self.slow[f.node].remove(f.slowdown)
        self._speed()

    # ---------------------------------------------------------- ftslurm's daemon
    def _tick(self, t: float) -> float:
        return (math.floor(t / DAEMON_POLL_S) + 1) * DAEMON_POLL_S

    def _arm(self, t: float, fast: bool = False) -> None:
        when = t + DAEMON_FAST_POLL_S if fast else self._tick(t)
        if when not in self.looks:
            self.looks.add(when)
            self.c.at(when, lambda: self._look(when))

    def _usable(self) -> list[str]:
        return [n.name for n in self.c.st.nodes.values()
                if n.status is NodeStatus.UP and n.dead_since is None]  # fmt: skip

    def _look(self, when: float) -> None:
        """One daemon cycle for the run: see an ending, requeue, exclude, release, start."""
        self.looks.discard(when)
        st, now, jid = self.c.st, self.c.now, self.jid
        job = st.jobs.get(jid)
        if job is None or (job.state is JobState.RUNNING and jid in self.c.runs):
            return
        if self.carry is not None and job.state.is_terminal:
            self._decide(job, requeued=False)
            model.requeue(st, jid, False, now)
            self.c.remaining[jid], self.carry = self.carry, None
            self.seen_restarts = job.restart_count
            self.r.count("requeues")
        if job.state is JobState.PENDING:
            if job.restart_count > self.seen_restarts:  # Slurm requeued it, or we moved it
                if not self.moved:
                    self._decide(job, requeued=True)
                self.moved = False
                self.seen_restarts = job.restart_count
            exclude = ftpolicy.plan_exclusions(self._flagged(now), self._usable(),
                                               self.trace.nodes)  # fmt: skip
            model.update_excluded_nodes(st, jid, list(exclude))
            model.release(st, jid)
            model.start_now(st, jid, now)
        self._arm(now)  # look again until it runs

    def _decide(self, job: model.MockJob, requeued: bool) -> None:
        """The daemon's classification of the ending, for the nodes it keeps out."""
        usable = set(self._usable())
        ending = ftpolicy.Ending(
            state=job.state, exit_code=job.exit_code, signal=job.signal,
            requeued_by_scheduler=requeued, nodes=tuple(self.alloc),
            down_nodes=tuple(n for n in self.alloc if n not in usable),
            checkpoint_signal_sent=job.warn_sent or job.state is JobState.COMPLETED,
            checkpoint_advanced=self.alloc_saved > 0)  # fmt: skip
        cause = ftpolicy.classify(ending, FTSLURM)
        d = ftpolicy.decide(cause, ending, self.budget, FTSLURM)
        self.budget = d.budget
        self.r.count(f"cause_{cause.value}")
        for node, _why in d.exclude:
            self._flag(node)

    def _flag(self, node: str) -> None:
        now = self.c.now
        ttl = ftpolicy.flag_ttl(self.flags.get(node), now, FTSLURM)  # repeat offenders: longer
        self.flags[node] = (now, now + (ttl if ttl is not None else math.inf))
        self.r.count("nodes_excluded")

    def _flagged(self, now: float) -> list[str]:
        live = [(since, n) for n, (since, exp) in self.flags.items() if exp > now]
        return [n for _, n in sorted(live, reverse=True)]  # newest first

    def _watch_straggler(self, node: str, since: float) -> None:
        """The straggler report flags `node` after `straggler_windows` full windows below
        the threshold; the daemon sees it at that look."""
        interval = FTSLURM.straggler_report_interval_s
        due = (math.floor(since / interval) + 1 + FTSLURM.straggler_windows) * interval
        alloc = self.alloc_serial
        self.c.at(due, lambda: self._straggler_due(node, alloc))

    def _straggler_due(self, node: str, alloc: int) -> None:
        slow = self.slow.get(node)
        if alloc != self.alloc_serial or not slow or not self._running(node):
            return
        if 1.0 / max(slow) >= FTSLURM.straggler_threshold:
            return  # not slow enough to score below the threshold
        live = self._flagged(self.c.now)
        if node in live:
            return
        self._flag(node)
        self.r.count("stragglers_flagged")
        exclusions = ftpolicy.plan_exclusions(self._flagged(self.c.now), self._usable(),
                                              self.trace.nodes)  # fmt: skip
        d = ftpolicy.straggler_move([node], self.alloc, exclusions, self.budget, FTSLURM)
        if d is None:
            return
        self.budget = d.budget
        self.r.count("straggler_moves")
        self.moved = True
        self.c.act(model.requeue(self.c.st, self.jid, True, self.c.now))
        self._arm(self.c.now, fast=True)


# ----------------------------------------------------------------------- reporting
def simulate(seed: int, sizes: list[int], days: float, fm: FailureModel = FailureModel(),
             setup: JobSetup = JobSetup(), queue_waits: tuple[float, ...] = (0.0,),
             ) -> dict[str, Any]:  # fmt: skip
    """Per size one trace, replayed under every policy for each queue wait q."""
    results: dict[str, Any] = {}
    for size in sizes:
        trace = draw_trace(seed, size, days, fm)
        runs: list[dict[str, Any]] = []
        for q in queue_waits:
            s = replace(setup, queue_wait_s=q)
            bnd = bounds(trace, s)
            per: dict[str, Any] = {}
            for pol in policies(s):
                started = time.perf_counter()
                res = Campaign(trace, pol, s).run()
                per[pol.key] = {
                    "label": pol.label, "ettr": res.ettr,
                    "ratio_to_bound": res.ettr / bnd["today"]["ettr"],
                    "ratio_to_strict": res.ettr / bnd["strict"]["ettr"],
                    "wall_s": res.wall_s, "productive_s": res.productive_s,
                    "lost_s": dict(res.lost_s), "counts": dict(sorted(res.counts.items())),
                    "sim_s": time.perf_counter() - started,
                }  # fmt: skip
            runs.append({"queue_wait_s": q, "bounds": bnd, "policies": per})
        results[str(size)] = {"trace": trace.facts(), "runs": runs}
    return results


# ------------------------------------------------------------------ the calibration
# Kokolis et al. (HPCA 2025, arXiv 2410.21680), RSC-1: a 16k-GPU job (2048 nodes of 8 GPUs)
# at r_f = 6.5 failures per 1000 node-days, u0 = 5 min, w = 0, q = 0 reaches ETTR ~0.70
# with a checkpoint every 60 min and ~0.93 every 5 min.
CALIBRATION_NODES = 2048
CALIBRATION_FAILURES_PER_NODE_DAY = 6.5e-3
CALIBRATION_RESTART_S = 300.0
CALIBRATION_CASES = ((3600.0, 0.70), (300.0, 0.93))  # (checkpoint interval, paper's ETTR)
CALIBRATION_TOLERANCE = 0.03


def calibration_setup(interval_s: float) -> tuple[FailureModel, JobSetup]:
    """The paper's assumptions in the simulator's terms: every failure stops the job at
    once and is seen at once (a crash the batch script requeues; no hang, no detection
    delay, no lemons, no stragglers, no maintenance), u0 is the whole time from the failure
    to training again (requeue delay 0: q = 0 has no BeginTime either), no wall limit."""
    fm = FailureModel(failures_per_node_day=CALIBRATION_FAILURES_PER_NODE_DAY, share_crash=1.0,
                      share_hang=0.0, lemon_fraction=0.0, lemon_share=0.0,
                      planned_per_node_day=0.0, straggler_episodes_per_node_day=0.0)
    setup = JobSetup(checkpoint_interval_s=interval_s, checkpoint_cost_s=0.0,
                     restart_cost_s=CALIBRATION_RESTART_S, queue_wait_s=0.0, wall_limit_s=None,
                     requeue_delay_s=0)  # fmt: skip
    return fm, setup


def calibrate(seed: int, days: float) -> list[dict[str, Any]]:
    """Plain requeue on the paper's 2048-node job, beside the paper's figure and the model."""
    rows = []
    plain = next(p for p in POLICIES if p.key == "plain")
    lam = CALIBRATION_NODES * CALIBRATION_FAILURES_PER_NODE_DAY / DAY
    for interval, paper in CALIBRATION_CASES:
        fm, setup = calibration_setup(interval)
        trace = draw_trace(seed, CALIBRATION_NODES, days, fm)
        res = Campaign(trace, plain, setup).run()
        rows.append({"interval_s": interval, "simulated": res.ettr, "paper": paper,
                     "formula": kokolis_ettr(lam, CALIBRATION_RESTART_S, interval),
                     "renewal": renewal_ettr(lam, CALIBRATION_RESTART_S, interval),
                     "failures_hit": res.counts.get("hit_crash", 0),
                     "ok": abs(res.ettr - paper) <= CALIBRATION_TOLERANCE})  # fmt: skip
    return rows


def print_calibration(rows: list[dict[str, Any]], seed: int, days: float) -> None:
    print(f"Calibration: plain requeue, {CALIBRATION_NODES} nodes, r_f = "
          f"{1000 * CALIBRATION_FAILURES_PER_NODE_DAY:g}/1000 node-days, u0 = "
          f"{CALIBRATION_RESTART_S:.0f} s, w = 0, q = 0; {days:g} days, seed {seed}")
    print(f"{'interval':>9} {'simulated':>9} {'paper':>6} {'off':>6} {'formula':>8} "
          f"{'renewal':>8} {'failures':>8}")
    for r in rows:
        print(f"{r['interval_s'] / 60:>7.0f} m {r['simulated']:>9.3f} {r['paper']:>6.2f} "
              f"{r['simulated'] - r['paper']:>+6.3f} {r['formula']:>8.3f} {r['renewal']:>8.3f} "
              f"{r['failures_hit']:>8}  {'ok' if r['ok'] else 'OFF'}")
    print(f"(fails beyond +-{CALIBRATION_TOLERANCE}; formula: Kokolis' first-order "
          "(1 - lam (u0 + dt/2)); renewal: the exact expectation of the same model)")


def assumptions() -> dict[str, Any]:
    names = ("FAILURES_PER_NODE_DAY", "SHARE_CRASH", "SHARE_HANG", "SHARE_NODE",
             "LEMON_FRACTION", "LEMON_SHARE", "HEALTHY_NODE_FAILURES_PER_NODE_DAY",
             "LEMON_NODE_FAILURES_PER_NODE_DAY", "REPAIR_S", "PLANNED_PER_NODE_DAY",
             "PREEMPT_GRACE_S", "MAINTENANCE_S", "STRAGGLER_EPISODES_PER_NODE_DAY",
             "STRAGGLER_DURATION_S", "STRAGGLER_SLOWDOWN", "SPARE_FRACTION",
             "CHECKPOINT_INTERVAL_S", "CHECKPOINT_COST_S", "RESTART_COST_S", "STEP_S",
             "WALL_LIMIT_S", "SLURMD_TIMEOUT_S", "REQUEUE_DELAY_S", "KILL_WAIT_S",
             "NCCL_WATCHDOG_S", "SUBMITIT_SIGNAL_DELAY_S", "HUMAN_RESUBMIT_MEDIAN_S",
             "HUMAN_RESUBMIT_SIGMA", "NEMO_RANK_HEARTBEAT_S", "NEMO_INITIAL_HEARTBEAT_S",
             "NEMO_IN_JOB_RESTARTS", "NEMO_JOB_RETRIES_ON_FAILURE", "NEMO_SIGNAL_LEAD_S",
             "FTSLURM_HANG_TIMEOUT_S",
             "FTSLURM_SETUP_TIMEOUT_S", "FTSLURM_SIGNAL_LEAD_S", "DAEMON_POLL_S")
    g = globals()
    out: dict[str, Any] = {n: g[n] for n in names}
    out["FTSLURM_EXCLUSION_TTL_S"] = FTSLURM.node_exclusion_ttl_s
    out["FTSLURM_EXCLUSION_MAX_TTL_S"] = FTSLURM.node_exclusion_max_ttl_s
    out["FTSLURM_STRAGGLER"] = {"interval_s": FTSLURM.straggler_report_interval_s,
                                "windows": FTSLURM.straggler_windows,
                                "threshold": FTSLURM.straggler_threshold}  # fmt: skip
    return out


def _pct(x: float, wall: float) -> str:
    return f"{100 * x / wall:.1f}" if wall else "-"


def _q(run: dict[str, Any]) -> str:
    return f"q = {run['queue_wait_s'] / 60:g} min"


EVENT_COLUMNS = (("allocations", "starts"), ("hit_node_failure", "node fail"),
                 ("hit_lemon", "lemon fail"), ("hit_crash", "crash"), ("hit_hang", "hang"),
                 ("hit_preemption", "preempt"), ("wall_limits", "wall limit"),
                 ("in_job_restarts", "in-job restart"), ("straggler_moves", "straggler move"),
                 ("nodes_excluded", "excluded"), ("human_resubmits", "by hand"),
                 ("over_default_budget", "default stop"))


def print_tables(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    for size, entry in out["results"].items():
        tr = entry["trace"]
        faults = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in
                           sorted(tr["faults_in_pool"].items()))  # fmt: skip
        for run in entry["runs"]:
            b, st = run["bounds"]["today"], run["bounds"]["strict"]
            caption = (f"today's bound {b['ettr']:.3f}: lam = {b['failures_per_day']:.2f}/day "
                       f"(lemons left out), Young/Daly {b['interval_s'] / 60:.0f} min, u0 = "
                       f"{b['restart_s']:.0f} s, w = {b['checkpoint_cost_s']:.0f} s\n"
                       f"strict bound {st['ettr']:.3f}: lam = {st['failures_per_day']:.2f}/day "
                       f"(whole fleet), Young/Daly {st['interval_s'] / 60:.0f} min, u0 = 0\n"
                       f"trace: {tr['pool_nodes']} nodes in the pool ({tr['lemon_nodes']} "
                       f"lemons): {faults}")  # fmt: skip
            t = Table(title=f"{size} nodes, {out['days']:g} days, seed {out['seed']}, "
                      f"{_q(run)}: ETTR, and the rest of the wall time by cause (%)",
                      caption=caption)  # fmt: skip
            t.add_column("policy", no_wrap=True)
            t.add_column("ETTR", justify="right")
            t.add_column("x today", justify="right")
            t.add_column("x strict", justify="right")
            for cause in CAUSES:
                t.add_column(CAUSE_LABELS[cause], justify="right")
            for p in run["policies"].values():
                t.add_row(p["label"], f"{p['ettr']:.3f}", f"{p['ratio_to_bound']:.3f}",
                          f"{p['ratio_to_strict']:.3f}",
                          *(_pct(p["lost_s"][k], p["wall_s"]) for k in CAUSES))  # fmt: skip
            console.print(t)
    t = Table(title="What hit the job, and what the policy did (counts)")
    t.add_column("nodes", justify="right")
    t.add_column("q", justify="right")
    t.add_column("policy", no_wrap=True)
    for _key, label in EVENT_COLUMNS:
        t.add_column(label, justify="right")
    for size, entry in out["results"].items():
        for j, run in enumerate(entry["runs"]):
            pols = list(run["policies"].values())
            for i, p in enumerate(pols):
                t.add_row(size if i == j == 0 else "", f"{run['queue_wait_s']:g} s" if i == 0
                          else "", p["label"],
                          *(str(p["counts"].get(k, 0)) for k, _ in EVENT_COLUMNS),
                          end_section=i == len(pols) - 1)  # fmt: skip
    console.print(t)
    console.print(f"simulated {len(out['results'])} sizes x {len(out['queue_waits_s'])} queue "
                  f"waits x {len(out['policies'])} policies x {out['days']:g} days in "
                  f"{out['elapsed_s']:.1f} s")  # fmt: skip
    for note in out["checks"]:
        console.print(f"check: {note}")


def markdown(out: dict[str, Any]) -> str:
    """The summary table of docs/performance.md."""
    keys = list(out["policies"])
    head = ["nodes", "q"] + [out["policies"][k] for k in keys] + ["today's bound",
                                                                   "strict bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for size, entry in out["results"].items():
        for run in entry["runs"]:
            cells = [size, f"{run['queue_wait_s'] / 60:g} min"]
            cells += [f"{p['ettr']:.3f} ({p['ratio_to_bound']:.3f})"
                      for p in (run["policies"][k] for k in keys)]  # fmt: skip
            cells += [f"{run['bounds']['today']['ettr']:.3f}",
                      f"{run['bounds']['strict']['ettr']:.3f}"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks(out: dict[str, Any]) -> list[str]:
    """Plausibility: what should hold, and whether it did."""
    notes: list[str] = []
    sizes = list(out["results"])
    for size in sizes:
        for run in out["results"][size]["runs"]:
            pols = run["policies"]
            best = max(pols, key=lambda k: pols[k]["ettr"])
            over = [k for k, p in pols.items() if p["ratio_to_bound"] > 1]
            over_strict = [k for k, p in pols.items() if p["ratio_to_strict"] > 1]
            notes.append(f"{size} nodes, {_q(run)}: highest ETTR {best}; "
                         + (f"ABOVE today's bound: {', '.join(over)}" if over
                            else "all below today's bound") + "; "
                         + (f"ABOVE the strict bound: {', '.join(over_strict)}" if over_strict
                            else "all below the strict bound"))  # fmt: skip
    if len(sizes) > 1:
        plain = [out["results"][s]["runs"][0]["policies"]["plain"]["ettr"] for s in sizes]
        falls = all(a >= b for a, b in zip(plain, plain[1:], strict=False))
        notes.append(f"plain requeue ETTR by size {' > '.join(f'{x:.3f}' for x in plain)}: "
                     + ("falls with size" if falls else "does NOT fall monotonically"))
    return notes


def plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(out["results"])
    keys = list(out["policies"])
    first = {s: out["results"][s]["runs"][0] for s in sizes}  # the first queue wait
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ys = [first[s]["policies"][key]["ettr"] for s in sizes]
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(sizes))]
        ax1.bar(xs, ys, width, label=out["policies"][key])
    for j, s in enumerate(sizes):
        ax1.hlines(first[s]["bounds"]["today"]["ettr"], j - 0.45, j + 0.45, colors="black",
                   linestyles="dashed", label="today's bound" if j == 0 else None)
        ax1.hlines(first[s]["bounds"]["strict"]["ettr"], j - 0.45, j + 0.45, colors="grey",
                   linestyles="dotted", label="strict bound" if j == 0 else None)  # fmt: skip
    ax1.set_xticks(range(len(sizes)), [f"{s} nodes" for s in sizes])
    ax1.set_ylabel("ETTR (productive / wall time)")
    lo = min(p["ettr"] for r in first.values() for p in r["policies"].values())
    ax1.set_ylim(max(0.0, lo - 0.1), 1.0)
    ax1.set_title(f"ETTR, {out['days']:g} days, seed {out['seed']}, {_q(first[sizes[0]])}")
    ax1.legend(fontsize=8, loc="lower left")
    big = first[sizes[-1]]["policies"]
    bottom = [0.0] * len(keys)
    for cause in CAUSES:
        vals = [100 * big[k]["lost_s"][cause] / big[k]["wall_s"] for k in keys]
        ax2.bar(keys, vals, bottom=bottom, label=CAUSE_LABELS[cause])
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    ax2.set_ylabel("% of wall time")
    ax2.set_title(f"Where the time went, {sizes[-1]} nodes")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finite(x: Any) -> Any:
    """The same structure with infinities (no failures: no interval) as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,1024,2048", help="job sizes in nodes")
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--failure-rate", type=float, default=1000 * FAILURES_PER_NODE_DAY,
                        help="unexpected interruptions per 1000 node-days, fleet average "
                             "(lemons included); default Llama 3's 3.79")  # fmt: skip
    parser.add_argument("--lemon-share", type=float, default=LEMON_SHARE,
                        help="share of the hardware failures carried by the lemon nodes "
                             f"({100 * LEMON_FRACTION:g}%% of the pool); default 10/14")
    parser.add_argument("--straggler-rate", type=float, default=STRAGGLER_EPISODES_PER_NODE_DAY,
                        help="fail-slow episodes per node-day")
    parser.add_argument("--interval", type=float, default=CHECKPOINT_INTERVAL_S,
                        help="checkpoint interval in seconds (of compute)")
    parser.add_argument("--checkpoint-write", type=float, default=CHECKPOINT_COST_S,
                        help="w: blocking checkpoint write in seconds")
    parser.add_argument("--restart", type=float, default=RESTART_COST_S,
                        help="u0: start-up plus checkpoint load in seconds, at every start")
    parser.add_argument("--queue-wait", default="0,600",
                        help="q: seconds each requeue waits for nodes held by other jobs, "
                             "comma-separated for several runs")  # fmt: skip
    parser.add_argument("--calibrate", action="store_true",
                        help="reproduce Kokolis et al. for plain requeue (exit 1 if off)")
    parser.add_argument("--plot", default="goodput.png", help="PNG to write ('' for none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--markdown", action="store_true",
                        help="print the summary table of docs/performance.md")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        args.queue_wait = _floats(args.queue_wait)
    except ValueError:
        parser.error("--sizes takes comma-separated integers, --queue-wait numbers")
    if not args.sizes or min(args.sizes) < 1 or args.days <= 0:
        parser.error("sizes must be positive, and --days too")
    if not args.queue_wait or min(args.queue_wait) < 0:
        parser.error("--queue-wait takes one or more seconds >= 0")
    if min(args.failure_rate, args.straggler_rate, args.checkpoint_write, args.restart) < 0:
        parser.error("rates and costs cannot be negative")
    if not 0 <= args.lemon_share <= 1:
        parser.error("--lemon-share is a share between 0 and 1")
    if not 0 < args.interval < math.inf:
        parser.error("--interval must be a positive number of seconds")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.calibrate:
        rows = calibrate(args.seed, args.days)
        if args.json:
            print(json.dumps({"seed": args.seed, "days": args.days, "calibration": rows}))
        else:
            print_calibration(rows, args.seed, args.days)
        return 0 if all(r["ok"] for r in rows) else 1
    fm = FailureModel(failures_per_node_day=args.failure_rate / 1000,
                      lemon_share=args.lemon_share,
                      straggler_episodes_per_node_day=args.straggler_rate)  # fmt: skip
    setup = JobSetup(checkpoint_interval_s=args.interval, checkpoint_cost_s=args.checkpoint_write,
                     restart_cost_s=args.restart)  # fmt: skip
    started = time.perf_counter()
    results = simulate(args.seed, args.sizes, args.days, fm, setup, args.queue_wait)
    out: dict[str, Any] = {"seed": args.seed, "days": args.days, "sizes": args.sizes,
                           "queue_waits_s": list(args.queue_wait),
                           "failure_model": asdict(fm), "job_setup": asdict(setup),
                           "policies": {p.key: p.label for p in POLICIES},
                           "causes": list(CAUSES), "results": results,
                           "elapsed_s": time.perf_counter() - started,
                           "assumptions": assumptions()}  # fmt: skip
    out["checks"] = checks(out)
    if args.plot:
        plot(out, args.plot)
    if args.json:
        json.dump(_finite(out), sys.stdout, allow_nan=False)
        sys.stdout.write("\n")
    elif args.markdown:
        print(markdown(out))
    else:
        print_tables(out)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
