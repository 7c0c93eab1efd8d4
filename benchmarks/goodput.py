"""Goodput of a month-long training job under fault-tolerance policies (three tools, ftslurm
and one variant per mechanism), on the same seeded failure traces, against the bounds.

For each job size (`--sizes`, nodes) one failure trace is drawn from `--seed` over `--days`
and replayed, unchanged, under each policy on the virtual-clock mock scheduler
(`ftslurm.backends.mock.virtual`), once per queue wait q (`--queue-wait`): the same Slurm
state machine decides placement, time limits, warning signals, the requeue delay and
node-failure detection. What happens after an attempt ends is decided and carried out by
the product itself: ftslurm's `Reconciler` (the daemon's reconcile loop: the pure `step`
and `policy` decide, the SQLite store records, the scheduler protocol acts) drives the
simulated cluster through `VirtualBackend`, on the virtual clock. Each baseline runs the
same core with its own settings (`tool_settings`) and one small variant (`ToolShell`:
the tool's job requeues itself at its ending, so nothing is held, excluded or started
early). This script plays only the world (the trace's faults; a person resubmitting a
failed run, through the store as `ftslurm submit` does) and the compute side (progress
and checkpoints, in-job restarts, hang and crash detection, and the files the job writes
for the daemon: progress.json, the launchers' node reports with `decide_outcome`'s exit
code, the straggler report); it calls no scheduler action itself. Reported per size, q
and policy: ETTR (productive time / wall time), where the rest of the wall time went, and
the ETTR as a share of each bound.

    python benchmarks/goodput.py [--sizes 128,1024,2048] [--days 30] [--seed 1]
        [--failure-rate 3.79] [--lemon-share 0.714] [--straggler-rate 0.002]
        [--interval 1800] [--checkpoint-write 60] [--restart 300] [--queue-wait 0,600]
        [--snapshot 6] [--memory-save 6] [--memory-restart 246] [--policies KEY,...]
        [--plot goodput.png] [--json | --markdown]
    python benchmarks/goodput.py --calibrate [--days 30] [--seed 1]

The code keeps three things apart: the failure trace (`FailureModel`, `draw_trace`), the
policies (`Policy`: the settings the core runs with, who acts on an ending, what the
compute side does; `Campaign`, which replays a trace under one policy through the core)
and the reporting (`simulate`, `bounds`, the tables). Every knob has a flag; the defaults
are the sourced constants below (q: 0 and 10 min, both reported).

How the loop is driven: ftslurm's daemon looks when `Reconciler.cycle()` says (1 s after
a change, backing off to 60 s); a baseline's job acts at its own ending at once, and its
bookkeeping looks on the same schedule. At the 60 s ceiling, looks between two events
decide nothing new (`step` is pure and none of its inputs changed; what time alone brings
due it announces as a deadline), so the driver skips them, keeping the daemon's grid:
the first look after an event or a deadline is the first grid time at or after it.

Policies
  plain     `sbatch --requeue` with periodic checkpoints. Every early ending is requeued
            with Slurm's requeue delay: by Slurm itself after a node failure (NODE_FAIL,
            detected after SlurmdTimeout) or a preemption (PreemptMode=REQUEUE), by the
            batch script's `scontrol requeue` after a failed step or a wall-limit SIGTERM (the
            pattern of TorchX's template). No checkpoint on any signal; a hang waits for the
            NCCL watchdog; repaired nodes (lemons too) come back and are allocated again.
            In the core: `tool_settings(use_launcher=False)` under `ToolShell`.
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
            In the core: `tool_settings` with cause_budgets crash/hang/oom = 0 (the run
            ends FAILED; the person submits a new run), its `--signal=USR2@90` in the job
            header, under `ToolShell`.
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
            In the core: `tool_settings(num_in_job_restarts=3)`, `--signal=USR2@90` in the
            job header, under `ToolShell`.
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
            leaves no time to save). The straggler settings are left at their defaults:
            the threshold, the interval and the windows the simulated launcher scores with
            are those the daemon rendered into the job's batch script (the rule
            `ftslurm.core.settings.straggler_threshold`: 0.75, or 0.9 under live recovery
            with spares). In the core: the `Reconciler` itself, unchanged,
            with FTSLURM's settings; its signal lead comes from the save time the job
            reports in progress.json. A dead node is reported by the survivors'
            launchers PEER_DETECT_S (peer_timeout_s 20 s + one 3.3 s poll;
            ftslurm.agent.peers) after it died, as `recovery/lost-<n>.json`; the daemon
            then ends the job and submits a new one without the node, without waiting for
            SlurmdTimeout (a cancelled job frees its live nodes at once; a requeued one would
            stay COMPLETING on the dead node until SlurmdTimeout:
            tests/data/lost_node_cancel_resubmit_22.05.txt).
  ftslurm, Slurm detects
            The same, without the launchers' peer-loss detection (ftslurm before it): a dead
            node is known only from Slurm's NODE_FAIL after SlurmdTimeout.
  ftslurm + spares
            ftslurm with `spare_nodes` K = spares_for(N) = 0.25% of N, at least 1 (assumed):
            each allocation holds N + K nodes (--no-kill) and trains on N. When the
            launchers report an active node lost, or the straggler report names one
            persistent (its launcher steps out: `recovery/benched-<n>.json`), the survivors
            take a spare in and restart the ranks inside the job from the last checkpoint
            (the restart cost u0, no requeue, no queue wait q), under the one rule the
            daemon follows too (`ftslurm.core.recovery`: not the batch host, no more out
            than spares); a lost idle spare leaves one fewer; past that the job ends and a
            new one runs, as above (a straggler: moved by held requeue).
            The spares' cost is reported beside their gain: K idle node-hours per
            hour held, against the productive node-hours gained over ftslurm without them.
  ftslurm + async, tuned
            ftslurm with asynchronous disk saves (`ftslurm.checkpoint`): a save blocks for
            its snapshot (ASYNC_SNAPSHOT_S), its write (CHECKPOINT_COST_S) goes on in the
            background and counts once done; and the tuned cadence: the job checkpoints at
            the interval the daemon writes into the run directory (checkpoint_interval
            "auto": `ftslurm.core.cadence`, Daly's optimum from the save times the job
            reports in progress.json and the node failures the daemon's store has seen in
            this simulation, never shorter than the write), read at every start (before the
            daemon's first file: the fixed 30 min).
  ftslurm + memory tier, tuned
            ftslurm with the memory tier (`ftslurm.memory_checkpoint`: node memory plus a
            peer replica, MEMORY_SAVE_S per save) and the tuned cadence's two intervals
            (memory; disk, a multiple of it); disk saves synchronous. A restart inside the
            allocation (crash, hang, spare swap) resumes from the newest memory checkpoint
            at MEMORY_RESTART_COST_S; a new allocation from the newest disk checkpoint.
  ftslurm, everything
            ftslurm + spares, async saves, the memory tier and the tuned cadence together.
  ftslurm, live recovery
            ftslurm, everything, with live recovery (`ftslurm.agent.live`, opt-in on the rank
            side): the healthy ranks keep their processes, the process group is formed
            again over a coordinator store (hosted by the launcher of node rank 0), the
            ranks that lack the state receive it from a healthy data-parallel replica, and
            the step the fault interrupted runs again (a step commits only when every rank
            finished it). What a fault costs (the LIVE_* constants below), the job
            standing still meanwhile:
              a crash: the launcher's detection (0.5 s) + LIVE_RANK_RECOVERY_S (the rank
                restarted alone, set up, the group formed again, its state received) +
                one step;
              a hang, a spare left and not on the batch host: the learned hang timeout
                (30.5 s), then the hung node steps out (`launch_core.on_hang`: its
                launcher writes its bench record, why "hang", and kills its ranks; no
                in-job restart used) and a warm spare takes its ranks over:
                LIVE_SPARE_RECOVERY_S + one step (the product steps it out only when
                its launchers' claims tell it from the ranks blocked on it: a frozen
                rank, or one behind; else every rank restarts in place: an upper bound,
                docs/performance.md);
              a hang on the batch host (it may not step out) or with no spare left: the
                hang timeout + its look at the rank (0.5 s) + the claims' wait (2 s) +
                BENCH_WAIT_S (5 s: `on_hang` waits for a peer to step out), then every
                rank restarts in place from the memory tier, as in
                "ftslurm, everything" (one in-job restart);
              a lost node with a spare (not the batch host, no more out than spares):
                PEER_DETECT_S + LIVE_SPARE_RECOVERY_S (the spare's ranks started, set up,
                the group formed again, the node's state received) + one step;
              a persistent straggler with a spare: its launcher steps out
                LIVE_STEP_OUT_STEPS slow steps after the straggler report, then
                LIVE_SPARE_RECOVERY_S + one step. With the `live_recovery` setting and
                spares the product's default threshold is 0.9 (a node 1.11x slower) once
                a replicated state is attached (a sharded one keeps 0.75),
                not 0.75 (1.33x): stepping out to a warm spare costs about a second; a
                node it flags with no spare left moves the job only below 0.75
                (`straggler_move_threshold`). The trace's healthy nodes have identical
                speeds, so no healthy node is ever flagged: the sensitive threshold's
                false step-outs on a noisy cluster are not in these figures.
            The product recovers a crashed rank live, and with the `live_recovery`
            setting and a warm spare a lost node and a node stepping out, a straggler or
            a hung node (docs/agent.md). The script counts each kind apart (live_crash,
            live_hang, live_node, live_straggler; hang_step_outs).
            The training layout this holds for: a state REPLICATED across data-parallel
            replicas (pure data parallel, DDP, or sharding only within a replica as
            TorchFT's HSDP), so the handover finds every lost rank's part on a peer.
            Not covered, so as in "ftslurm, everything": the batch host lost (its node
            holds the coordinator: 1/N of the node failures, as the trace falls), more
            losses than spares, a fault during a start-up or during another recovery
            (a crash or hang then is ignored, as under any stall; a node failure takes
            the old path), a crash once the allocation's in-job restarts are spent (a
            rank restarted alone uses one, as in the product), wall limits and
            preemptions. Every step pays the commit, LIVE_COMMIT_SHARE of the compute
            time (charged to "checkpoint"). The tuned cadence is the product's for a run
            that recovers live (the `live_recovery` setting, and `live_recovery` in the
            job's progress.json): both tiers' intervals are Daly's for the time between
            the node failures live recovery cannot serve, M / (1 - c), c =
            `ftslurm.core.cadence.live_coverage(N, K)` (the batch host's loss and losses
            beyond the spares end the job).
  ftslurm, live recovery, sharded state
            The same product and settings for a state SHARDED without a replica
            dimension (FSDP or ZeRO over every data-parallel rank; the script says so,
            `group.attach(replicated=False)`): Llama 3 405B as its paper trained it (FSDP
            sharding the optimizer states and gradients over the data-parallel ranks,
            arXiv 2407.21783, section 3.3.2). A fault in which every member kept its part
            would still recover live; none in the trace is one: a crashed rank, a lost,
            hung or benched node each leave a rank without its part, so once the round
            has formed every rank gives up (SHARDED, `live_rules.handover_fallback`) and
            the launcher restarts every rank from the memory tier (docs/agent.md,
            "Sharded states"). What a fault costs: the detection, the live attempt
            (a crash: LIVE_SHARDED_RANK_S, the rank restarted alone, set up, the round
            formed, one in-job restart; a node taken over by a warm spare:
            LIVE_SHARDED_SPARE_S, the round formed), then the restart of every rank from
            memory (MEMORY_RESTART_COST_S and the work since the newest memory
            checkpoint; after a crash one more in-job restart, after a take-over none,
            as a spare swap). The cadence is today's: rank 0 does not tell the daemon
            the ranks recover live for a state attached as sharded, since live recovery
            serves none of its faults (`LiveGroup.attach`).
  The fixed-cadence ftslurm policies pin checkpoint_interval to the setup's 30 min (what
  their daemon writes); the baselines have no cadence file.
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
  ASYNC_SNAPSHOT_S = 6    what an asynchronous disk save blocks (PyTorch blog, "Reducing
      Model Checkpointing Times by Over 10x with PyTorch Distributed Asynchronous
      Checkpointing", 2024: 7B, 148.8 s synchronous, 6.3 s blocking asynchronous); its
      write, CHECKPOINT_COST_S, in the background (MegaScale, NSDI'24: GPU to host in
      "several seconds", then asynchronously to HDFS).
  MEMORY_SAVE_S = 6    a memory-tier save: the same GPU-to-host snapshot, the copy to the
      partner node assumed overlapped with it (Gemini, SOSP'23, interleaves checkpoint
      traffic with training; ByteRobust, SOSP'25: per-step in-memory checkpoints under 1%).
  MEMORY_RESTART_COST_S = 300 - 60 + 6 = 246    a restart from memory keeps the start-up
      and swaps the load from storage (assumed as long as the write) for a memory copy.
  STEP_S = 10    training step time (assumed), from which ftslurm's hang timeout is learned.
  WALL_LIMIT_S = 20 h    typical HPC wall limit (Bekman, ml-engineering).
Live recovery (the live policy only; docs/agent.md, "Live recovery"):
  LIVE_CRASH_MEASURED_S = 3.21    measured (benchmarks/live_recovery.py, docs/performance.md
      section 4: one node, 3 ranks, gloo on CPU, 0.1 s steps): what a crashed rank costs on
      the live path (8.01 s on today's in-job restart), mostly the new process's Python and
      torch start-up. LIVE_RANK_RESTART_S = 3.21 - 0.5 (the launcher's detection, charged
      apart) - 0.1 (the measurement's step, charged apart at STEP_S) = 2.61 s.
  LIVE_COMMIT_S = 0.33 ms per step    measured there too (one store add and one wait),
      LIVE_COMMIT_SHARE = 0.33 ms / STEP_S = 3.3e-5 of the compute time. With 3 ranks: at
      16k ranks voting on one store it may cost more (each 10 ms is 0.1% of a 10 s step).
  LIVE_RANK_SETUP_S = 30    assumed: the restarted rank's set-up on a GPU node (CUDA
      context, its model shard, the data loader), which the CPU measurement lacks.
  LIVE_REFORM_S = 20    the process group formed again over the whole job. Published:
      TrainMover (arXiv 2412.12636) reports about 20 s of downtime per interruption at 1024
      GPUs with standby machines; TorchFT's README (pytorch/torchft) gives no time for its
      quorum and re-configuration, its example lighthouse waits up to --join_timeout_ms
      10000 for replicas to join. Taken for the re-formation alone at 16k GPUs: assumed.
  LIVE_NODE_TRANSFER_S = 16.2    a node's share of the training state from a healthy
      replica: Llama 3 405B (arXiv 2407.21783, the 16k-GPU run whose rates the trace uses)
      at 16 bytes per parameter (assumed: bf16 weights and gradients, fp32 master weights
      and two Adam moments), one data-parallel replica over 16 nodes of 8 GPUs (8-way
      tensor x 16-way pipeline parallel): 405 GB per node, at 25 GB/s into a node
      (assumed). LIVE_RANK_TRANSFER_S = 2.0: one rank's eighth of it. The live policy
      assumes the state replicated across data-parallel replicas (sharded only within
      one, as TorchFT's HSDP), so every node's share has a copy elsewhere; the paper's
      own FSDP shards optimizer states and gradients over the data-parallel ranks: that
      layout is the sharded variant's (LIVE_SHARDED_*).
  LIVE_RANK_RECOVERY_S = 2.61 + 30 + 20 + 2.0 = 54.6    a crashed rank back in.
  LIVE_SPARE_RECOVERY_S = 20 + 16.2 = 36.2    a spare in a lost node's place: its ranks
      wait warm, started and set up ahead of time (`live_recovery`, as ByteRobust's warm
      standbys, arXiv 2509.16293), so only the re-formation and the node's state count.
  LIVE_REDONE_S = STEP_S    the interrupted step runs again: at most one, charged in full
      (an upper bound; on average half of it had been computed).
  LIVE_STEP_OUT_STEPS = 3    assumed: a benched straggler's launcher steps out at a step
      boundary within a few steps.
  LIVE_SHARDED_RANK_S = 2.61 + 30 + 20 = 52.6, LIVE_SHARDED_SPARE_S = 20    the sharded
      variant's live attempt before every rank gives up (a crashed rank restarted alone
      and set up, the round formed; a warm spare's round formed), then the restart of
      every rank from memory (MEMORY_RESTART_COST_S).
  BENCH_WAIT_S = 5    `ftslurm.agent.spare_rules`: how long a node with spares that finds
      its ranks hung but may not step out waits for a peer to, before it restarts its
      ranks in place; after FROZEN_LOOK_S = 0.5 (`launch_io`: its look at the hung rank)
      and HANG_CLAIM_WAIT_S = 2 (the other nodes' claims of the hang).
Slurm (mock defaults): SlurmdTimeout 300 s, requeue delay 120 s (cred_expire; BeginTime is
+121 s), KillWait 30 s, MinJobAge 300 s. PyTorch's NCCL watchdog: 600 s (10 min default).

Where the wall time goes (the categories add up to the wall time):
  productive  work computed and kept (the run in flight at the end counts in full)
  lost work   work computed, then lost to an interruption (redone later)
  startup     start-up and checkpoint loading, at every start and in-job restart
  checkpoint  blocking checkpoint writes, periodic and on a signal (and live recovery's
              per-step commit)
  detection   nobody has acted yet: a dead node until Slurm or the launchers notice it, a
              crashed rank until the launcher sees it, an ended job until the daemon's next
              look
  hung        a hang until a watchdog or heartbeat timeout fires
  requeue     back in the queue: the requeue delay, then waiting for nodes
  human       a failed job waiting for a person to resubmit it (submitit)
  stragglers  running below full speed because a node of the allocation is slow

Queue wait q (`--queue-wait`, seconds, default 0 and 600): other jobs hold the nodes for q
after every requeue and resubmission, so the job cannot start before it went back to the
queue + q, whatever its BeginTime (a start-now included; Slurm's 121 s requeue delay runs
within q). It is charged to "requeue". An in-job restart does not leave the allocation and
pays no q.

The bounds per size and q, Kokolis' queue-aware formula at the Young/Daly interval
dt* = sqrt(2 w / lam) (`ftslurm.core.cadence.young`):
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
  async     today's and strict with w = ASYNC_SNAPSHOT_S: the bounds of the policies that
            save asynchronously or to memory ("x today" and "x strict" of those policies).
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

Cost: the simulation is single-threaded and runs the daemon's real loop and SQLite store
(in a temporary folder, on /dev/shm where there is one): ftslurm's daemon looks about once
a minute while a job runs (it reads the straggler report every report interval), about
43,000 cycles a simulated month. The default three sizes under two queue waits and the
first ten policies (60 simulations) took 58 min of wall time on a shared 2-core machine as
two processes side by side (`--policies`: the nine others, 58 min; the live policy, 10 min);
the two live policies (12 simulations) 17-18 min as two processes side by side,
`--calibrate` under a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ftslurm.agent.heartbeat import Timeouts
from ftslurm.agent.launch import decide_outcome, tightened
from ftslurm.agent.launch import parse_args as launcher_args
from ftslurm.agent.launch_io import FROZEN_LOOK_S
from ftslurm.agent.peers import poll_interval
from ftslurm.agent.spare_rules import BENCH_WAIT_S, HANG_CLAIM_WAIT_S
from ftslurm.backends.mock import model
from ftslurm.backends.mock.model import MockConfig, MockNodeSpec, NodeStatus
from ftslurm.backends.mock.virtual import JobModel, RunBreakdown, VirtualBackend, VirtualCluster
from ftslurm.backends.protocol import SchedulerBackend
from ftslurm.core.cadence import Cadence, young
from ftslurm.core.contract import ExitCode, JobEnv, RunDir
from ftslurm.core.contract.reports import (
    Benched,
    NodeReport,
    PeerLost,
    Progress,
    StragglerReport,
    StragglerScore,
)
from ftslurm.core.recovery import Recovery, recovery
from ftslurm.core.settings import Cause, FtSettings, straggler_threshold
from ftslurm.core.timefmt import format_limit_exact
from ftslurm.core.types import JobOptions, JobState
from ftslurm.daemon import policy as ftpolicy
from ftslurm.daemon import step as core
from ftslurm.daemon.reconcile import Reconciler
from ftslurm.daemon.records import Attempt, Run, RunState, new_run_record
from ftslurm.daemon.store import Store
from ftslurm.daemon.submission import make_spec
from ftslurm.fsutil import read_json
from ftslurm.recipe import Recipe
from ftslurm.runfiles import write_report

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
HEALTHY_NODE_FAILURES_PER_NODE_DAY = (
    FAILURES_PER_NODE_DAY * SHARE_NODE * (1 - LEMON_SHARE) / (1 - LEMON_FRACTION)
)
LEMON_NODE_FAILURES_PER_NODE_DAY = (
    FAILURES_PER_NODE_DAY * SHARE_NODE * LEMON_SHARE / LEMON_FRACTION
)  # 206x: every ~6 days
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
# Asynchronous saves (ftslurm.checkpoint): the step blocks for the snapshot only; the write
# (the same CHECKPOINT_COST_S) goes on in the background. PyTorch blog, "Reducing Model
# Checkpointing Times by Over 10x with PyTorch Distributed Asynchronous Checkpointing"
# (2024): a 7B model's blocking time 148.8 s synchronous, 6.3 s asynchronous.
ASYNC_SNAPSHOT_S = 6.0
# The memory tier (ftslurm.memory_checkpoint): the same GPU-to-host snapshot (MegaScale,
# NSDI'24: "several seconds"), the copy to the partner node assumed overlapped with it.
MEMORY_SAVE_S = ASYNC_SNAPSHOT_S
# A restart from memory (in the allocation) keeps the start-up and swaps the load from
# storage (assumed to take as long as the write, CHECKPOINT_COST_S) for a memory copy.
MEMORY_RESTART_COST_S = RESTART_COST_S - CHECKPOINT_COST_S + MEMORY_SAVE_S  # 246 s
WALL_LIMIT_S = 20 * HOUR  # typical HPC wall limit (Bekman, ml-engineering)
# The pre-flight health check (ftslurm.agent.health) in the simulation: at an allocation's
# start, each lemon in it whose next failure would strike within the allocation (the wall
# limit) is caught with probability HEALTH_CATCH: its launcher fails the check
# HEALTH_CHECK_S into the start, before any rank trained, and leaves as a lost node does
# (the daemon flags it; a spare takes its place, or a new job runs without it), so that
# failure costs a restart but no work since the last checkpoint, and the lemon is kept out
# by its flag. HEALTH_CATCH = 0.5 is an assumption, stated with its reasoning: Llama 3's
# interruptions (arXiv 2407.21783, Table 5) were mostly GPU and GPU-memory faults (faulty
# GPU 30.1%, HBM3 memory 17.2%, GPU SRAM 4.5%, GPU system processor 4.1%: 56% of them, 71%
# of the hardware ones), the kind a few seconds of checks see when the fault is present at
# the start (a GPU missing from the device count or raising in a small kernel, memory held
# or retired pages, a read-only or full disk, a dead NIC through the transfer), and lemons
# are nodes whose fault stays (Kokolis et al., arXiv 2410.21680: "a repair does not cure
# it"); but a lemon fails intermittently and a check of a few seconds cannot run the long
# diagnostics (DCGM's level 3 takes minutes) nor see a fault that appears under load, so
# about half of those failures are taken as visible at the start. `--health-catch` changes
# it; docs/performance.md gives the 2048-node ETTR at 0, 0.5 and 1.
HEALTH_CATCH = 0.5
HEALTH_CHECK_S = 5.0  # the check's bound (HealthConfig.timeout_s): when a caught lemon leaves

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
FTSLURM = FtSettings(
    num_in_job_restarts=NEMO_IN_JOB_RESTARTS,
    stop_if_straggler=True,
    num_job_retries_on_failure=10**9,
)
_LAUNCHER = launcher_args(["--", "train"])  # the launcher's defaults
FTSLURM_MONITOR_S = _LAUNCHER.monitor_interval  # 0.5 s
FTSLURM_SETUP_TIMEOUT_S = 600.0  # configured "setup" section timeout (never tightened)
FTSLURM_HANG_TIMEOUT_S = tightened(
    Timeouts(sections={"setup": FTSLURM_SETUP_TIMEOUT_S, "step": 180.0}, out_of_section=300.0),
    [{"step": STEP_S}],
    _LAUNCHER.safety_factor,
).sections["step"]  # max(30, 3 x 10 s)
FTSLURM_SIGNAL_LEAD_S, _ = ftpolicy.checkpoint_lead(FTSLURM.preempt_time, CHECKPOINT_COST_S)
# (at the default w; `policies(setup)` computes it for the setup's w)
# Peer-loss detection (ftslurm.agent.peers): a node's launcher silent for peer_timeout_s is
# reported by a neighbour at its next poll (peer_timeout_s / 6): 20 + 3.3 s.
PEER_DETECT_S = FTSLURM.peer_timeout_s + poll_interval(FTSLURM.peer_timeout_s)
# Hot spares per active node (assumed): 0.25%, at least one, about the node failures one
# 20-h allocation of 2048 nodes meets at the trace's rates (lemons included at first).
SPARE_SHARE = 0.0025
DAEMON_POLL_S = 60.0  # the daemon looks at least this often (next_poll_interval's ceiling)
DAEMON_FAST_POLL_S = 1.0  # ... and this soon after its own action (its floor)

# ------------------------------------------- live recovery (ftslurm.agent.live), per fault
# Measured (benchmarks/live_recovery.py, docs/performance.md section 4: one node, 3 ranks,
# gloo on CPU, 0.1 s steps): a crashed rank costs 3.21 s on the live path (8.01 s on today's
# in-job restart). That holds the launcher's detection (FTSLURM_MONITOR_S, charged apart
# here), the new process's start (Python, the torch import), the group formed again over 3
# ranks, a tiny state received, and the 0.1 s step run again (charged apart at STEP_S). The
# commit costs 0.33 ms per step there.
LIVE_CRASH_MEASURED_S = 3.21
LIVE_BENCH_STEP_S = 0.1  # the measurement's step
LIVE_RANK_RESTART_S = LIVE_CRASH_MEASURED_S - FTSLURM_MONITOR_S - LIVE_BENCH_STEP_S  # 2.61 s
LIVE_COMMIT_S = 0.33e-3
LIVE_COMMIT_SHARE = LIVE_COMMIT_S / STEP_S  # of the compute time, 3.3e-5 at 10 s steps
# What a CPU cannot show, from published figures or assumed (each says which):
# - the restarted rank's set-up on a GPU node (CUDA context, its model shard built, the data
#   loader), none of which the CPU measurement has: assumed;
LIVE_RANK_SETUP_S = 30.0
# - the process group formed again over the whole job (every rank joins the next round, the
#   NCCL communicators are built again). Published: TrainMover (arXiv 2412.12636) reports
#   about 20 s of downtime per interruption at 1024 GPUs with standby machines and an
#   incremental communicator set-up; TorchFT's README gives no time for its quorum and its
#   example lighthouse waits up to --join_timeout_ms 10000. Taken: 20 s for the
#   re-formation alone at 16k GPUs (an assumption: a full NCCL rebuild at that scale may
#   take longer; the table in docs/performance.md gives the ETTR per 10 s more);
LIVE_REFORM_S = 20.0
# - the state handed over: the model is Llama 3 405B (arXiv 2407.21783), the 16k-GPU run
#   whose failure rates the trace uses, at 16 bytes per parameter (mixed-precision Adam:
#   bf16 weights and gradients, fp32 master weights and two moments; an upper bound, the
#   gradients being computed again), one data-parallel replica over 16 nodes of 8 GPUs
#   (8-way tensor x 16-way pipeline parallel, the paper's layout at 16k GPUs), received at
#   25 GB/s per node from the matching ranks of a healthy replica (assumed: a fraction of a
#   node's links; the paper's cluster has 400 Gb/s RoCE per GPU). A node's share: 405 GB
#   in 16.2 s; a rank's: 2.0 s. Assumed too: every node's state has a copy on another node
#   (replicated across data-parallel replicas, sharded only within one, as TorchFT's HSDP;
#   with optimizer state sharded over every data-parallel rank, as the paper's FSDP does,
#   a lost node's share would exist nowhere else: the sharded variant, LIVE_SHARDED_*).
MODEL_PARAMS = 405e9
STATE_BYTES_PER_PARAM = 16
NODES_PER_REPLICA = 16
GPUS_PER_NODE = 8  # Kokolis' RSC-1: 16k GPUs on 2048 nodes
STATE_BANDWIDTH_BPS = 25e9
LIVE_NODE_STATE_BYTES = MODEL_PARAMS * STATE_BYTES_PER_PARAM / NODES_PER_REPLICA  # 405 GB
LIVE_NODE_TRANSFER_S = LIVE_NODE_STATE_BYTES / STATE_BANDWIDTH_BPS  # 16.2 s
LIVE_RANK_TRANSFER_S = LIVE_NODE_TRANSFER_S / GPUS_PER_NODE
# A crashed rank: its launcher restarts it alone, it sets up, the group is formed
# again, the rank receives its state (54.6 s). A spare taking a lost (or benched) node's
# place: its ranks waited warm (started and set up ahead of time, `live_recovery`), the
# group is formed again and the node's state received (36.2 s).
LIVE_RANK_RECOVERY_S = (
    LIVE_RANK_RESTART_S + LIVE_RANK_SETUP_S + LIVE_REFORM_S + LIVE_RANK_TRANSFER_S
)
LIVE_SPARE_RECOVERY_S = LIVE_REFORM_S + LIVE_NODE_TRANSFER_S
# A sharded state without a replica dimension (`group.attach(replicated=False)`, the
# "sharded" variant): a rank that lost its part makes every rank give up once the round has
# formed and the handover finds it lacking (`live_rules.handover_fallback`, SHARDED), and
# the launcher restarts every rank from the memory tier (today's path). What the live
# attempt cost before it gave up: a crashed rank's restart, set-up and the re-formation
# (52.6 s); a warm spare's re-formation (20 s).
LIVE_SHARDED_RANK_S = LIVE_RANK_RESTART_S + LIVE_RANK_SETUP_S + LIVE_REFORM_S
LIVE_SHARDED_SPARE_S = LIVE_REFORM_S
# Then the step the fault interrupted runs again: at most one, charged in full (an upper
# bound: on average half of it had been computed when the fault came).
LIVE_REDONE_S = STEP_S
# A persistent straggler's launcher steps out at a step boundary within a few steps of the
# straggler report (assumed 3, at the straggler's slow pace).
LIVE_STEP_OUT_STEPS = 3

CAUSES = (
    "lost_work",
    "startup",
    "checkpoint",
    "detection",
    "hung",
    "requeue",
    "human",
    "stragglers",
)
CAUSE_LABELS = {
    "lost_work": "lost work",
    "startup": "startup",
    "checkpoint": "checkpoint",
    "detection": "detection",
    "hung": "hung",
    "requeue": "requeue",
    "human": "human",
    "stragglers": "stragglers",
}


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
        return (
            self.failures_per_node_day
            * self.share_node
            * (1 - self._lemon_share)
            / (1 - self.lemon_fraction)
        )

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

    checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S  # of the fixed-cadence policies
    checkpoint_cost_s: float = CHECKPOINT_COST_S  # w (synchronous; an async save's write)
    restart_cost_s: float = RESTART_COST_S  # u0 (from disk)
    snapshot_s: float = ASYNC_SNAPSHOT_S  # what an asynchronous disk save blocks
    memory_save_s: float = MEMORY_SAVE_S  # what a memory-tier save blocks
    memory_restart_s: float = MEMORY_RESTART_COST_S  # u0 of a restart from memory
    queue_wait_s: float = 0.0  # q: other jobs hold the nodes this long after each requeue
    wall_limit_s: float | None = WALL_LIMIT_S  # None: no wall limit
    requeue_delay_s: int = REQUEUE_DELAY_S
    slurmd_timeout_s: int = SLURMD_TIMEOUT_S


# ------------------------------------------------------------------- the bounds (pure)
def kokolis_ettr(
    failure_rate_per_s: float,
    restart_s: float,
    interval_s: float,
    checkpoint_cost_s: float = 0.0,
    queue_s: float = 0.0,
    queued_rate_per_s: float | None = None,
) -> float:
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


def ideal_bound(
    nodes: int,
    failures_per_node_day: float,
    restart_s: float,
    checkpoint_cost_s: float,
    queue_s: float = 0.0,
    queued_per_node_day: float = 0.0,
) -> dict[str, float]:
    """Kokolis' formula at the Young/Daly interval for lam = nodes x failures_per_node_day,
    with q charged to the failures that need a new allocation (queued_per_node_day)."""
    lam = nodes * failures_per_node_day / DAY
    lam_q = nodes * queued_per_node_day / DAY
    # Young's interval sqrt(2 w M) (ftslurm.core.cadence), Kokolis' dt*: inf without
    # failures, 0 for a free checkpoint
    dt = (
        math.inf
        if lam <= 0
        else young(checkpoint_cost_s, 1 / lam)
        if checkpoint_cost_s > 0
        else 0.0
    )
    if lam <= 0:
        ettr = 1.0
    elif dt == 0:
        ettr = max(0.0, 1 - lam * restart_s) / (1 + lam_q * queue_s)
    else:
        ettr = kokolis_ettr(lam, restart_s, dt, checkpoint_cost_s, queue_s, lam_q)
    return {
        "ettr": ettr,
        "failures_per_day": lam * DAY,
        "mttf_h": math.inf if lam <= 0 else 1 / lam / HOUR,
        "interval_s": dt,
        "restart_s": restart_s,
        "checkpoint_cost_s": checkpoint_cost_s,
        "queue_s": queue_s,
        "queued_failures_per_day": lam_q * DAY,
    }


def bounds(trace: Trace, setup: JobSetup) -> dict[str, dict[str, float]]:
    """The bounds for a trace: today's (u0 = the job's restart cost, lemons known in
    advance and never used: lam over the failures a job on healthy nodes sees) and the
    strict one (u0 = 0, lam over every failure in the fleet, lemons included), both with
    the synchronous w; and today's with the asynchronous snapshot as w ("async"), the bound
    of the policies that save asynchronously or to memory. Each at the Young/Daly
    interval, with q charged per node failure (a crash or hang can be restarted in the
    allocation, a dead node cannot)."""
    q = setup.queue_wait_s
    ordinary = trace.ordinary_failures_per_node_day()
    healthy_nodes = trace.node_failures_per_node_day(lemons=False)
    today = ideal_bound(
        trace.nodes, ordinary, setup.restart_cost_s, setup.checkpoint_cost_s, q, healthy_nodes
    )
    strict = ideal_bound(
        trace.nodes,
        trace.fleet_failures_per_node_day(),
        0.0,
        setup.checkpoint_cost_s,
        q,
        trace.node_failures_per_node_day(lemons=True),
    )
    snapshot = min(setup.snapshot_s, setup.memory_save_s)
    fast = ideal_bound(trace.nodes, ordinary, setup.restart_cost_s, snapshot, q, healthy_nodes)
    fast_strict = ideal_bound(
        trace.nodes,
        trace.fleet_failures_per_node_day(),
        0.0,
        snapshot,
        q,
        trace.node_failures_per_node_day(lemons=True),
    )
    return {"today": today, "strict": strict, "async": fast, "strict_async": fast_strict}


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
        return self._per_node_day(anywhere, len(self.pool)) + self.node_failures_per_node_day(
            lemons=False
        )

    def node_failures_per_node_day(self, lemons: bool) -> float:
        """The trace's rate of node failures: over its healthy nodes (lemons=False) or over
        the whole pool, lemons' failures included."""
        if lemons:
            return self._per_node_day(
                sum(1 for f in self.faults if f.kind == "node"), len(self.pool)
            )
        healthy = sum(1 for f in self.faults if f.kind == "node" and not f.lemon)
        return self._per_node_day(healthy, len(self.pool) - len(self.lemons))

    def fleet_failures_per_node_day(self) -> float:
        """Every failure in the pool (lemons included) per node-day."""
        return self._per_node_day(
            sum(1 for f in self.faults if f.kind in FAILURE_KINDS), len(self.pool)
        )

    def facts(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for f in self.faults:
            key = "lemon_node" if f.lemon else f.kind
            counts[key] = counts.get(key, 0) + 1
        return {
            "nodes": self.nodes,
            "pool_nodes": len(self.pool),
            "spare_nodes": len(self.pool) - self.nodes,
            "lemon_nodes": len(self.lemons),
            "days": self.days,
            "faults_in_pool": counts,
            "ordinary_failures_per_1000_node_days": 1000 * self.ordinary_failures_per_node_day(),
            "trace_fleet_failures_per_1000_node_days": 1000 * self.fleet_failures_per_node_day(),
            "fleet_failures_per_1000_node_days": 1000 * self.model.failures_per_node_day,
            "lemon_failures_per_1000_node_days": 1000 * self.model.lemon_node_failures_per_node_day,
        }


def draw_trace(seed: int, nodes: int, days: float, fm: FailureModel = FailureModel()) -> Trace:
    """Everything that will go wrong, per node of the pool, over `days` (deterministic)."""
    rng = random.Random(f"goodput/{seed}/{nodes}/{float(days)!r}")
    pool = tuple(f"n{i}" for i in range(1, nodes + max(2, round(nodes * fm.spare_fraction)) + 1))
    lemons = frozenset(rng.sample(pool, round(len(pool) * fm.lemon_fraction)))
    horizon = days * DAY
    faults: list[Fault] = []

    def poisson(
        per_node_day: float, among: tuple[str, ...], make: Callable[[float, str], Fault]
    ) -> None:
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
    poisson(
        fm.lemon_node_failures_per_node_day,
        tuple(sorted(lemons)),
        lambda t, n: Fault(t, "node", n, lemon=True),
    )
    poisson(fm.planned_per_node_day, pool, lambda t, n: Fault(t, "maintenance", n))
    lo, hi = STRAGGLER_DURATION_S
    poisson(
        fm.straggler_episodes_per_node_day,
        pool,
        lambda t, n: Fault(
            t,
            "straggler",
            n,
            duration_s=math.exp(rng.uniform(math.log(lo), math.log(hi))),
            slowdown=rng.uniform(*STRAGGLER_SLOWDOWN),
        ),
    )
    faults.sort(key=lambda f: (f.at, f.kind, f.node))
    human = tuple(
        rng.lognormvariate(math.log(HUMAN_RESUBMIT_MEDIAN_S), HUMAN_RESUBMIT_SIGMA)
        for _ in range(4096)
    )
    return Trace(nodes, days, pool, lemons, tuple(faults), human, fm)


# ---------------------------------------------------------------------- the policies
WORKLOAD = "training"  # the one training every policy works on (its runs share its work)
UNLIMITED = 10**9  # "no budget" in FtSettings' integers
CONTINUE_CODE = int(ExitCode.CONTINUE)  # a job that saved on a signal asks to be continued


def tool_settings(**changes: Any) -> FtSettings:
    """A baseline tool's behaviour after an ending, in ftslurm's settings: budgets
    unlimited (see "Budgets"), no node kept out, no straggler handling, no checkpoint
    signal from a daemon (a tool's own `--signal` is in its job header: `Policy.signal`)."""
    return FtSettings(
        **{
            "num_job_retries_on_failure": UNLIMITED,
            "max_stalled_continuations": UNLIMITED,
            "preempt_time": 0,
            "exclude_failed_nodes": False,
            "exclude_stragglers": False,
            "stop_if_straggler": False,
            **changes,
        }
    )


@dataclass(frozen=True)
class Policy:
    """One policy: the settings the decision core runs with, who acts on an ending, and
    what happens inside the allocation (the compute side, modelled by `Campaign`)."""

    key: str
    label: str
    settings: FtSettings  # what the core (`step`, `policy`) decides with
    # True: ftslurm's daemon acts, at its own looks (held requeue, exclusions, release,
    # start now). False: the tool's job acts on its own ending at once (the batch script's
    # or the signal handler's `scontrol requeue`): nothing held, excluded or started early.
    daemon: bool
    signal: str | None  # the tool's own `--signal` in its job header (None: none)
    launcher: bool  # a per-node launcher reports how the node ended (node report, exit code)
    save_on_preempt: bool
    hang_timeout_s: float  # from the hang to the kill or in-job restart
    startup_hang_timeout_s: float  # same, for a hang during start-up
    crash_detect_s: float  # an in-job launcher sees a dead rank after this
    human_resubmit: bool = False  # a failed run is submitted again by a person
    # the launchers report a lost node within PEER_DETECT_S (ftslurm.agent.peers); else
    # only Slurm's NODE_FAIL after SlurmdTimeout tells of it
    peer_detect: bool = False
    # the tool's default stop after this many consecutive failed attempts; the simulated
    # budget is unlimited, and the campaign counts how often this default would have stopped
    default_failure_budget: int | None = None
    # The job's checkpoints (the compute side). `tuned`: it follows the interval(s) the
    # daemon writes into the run directory (`RunDir.cadence`, from the save times it reports
    # in progress.json and the store's failure history), read at every start; else every
    # JobSetup.checkpoint_interval_s. `async_save`: a disk save blocks for its snapshot, the
    # write goes on in the background. `memory_tier`: memory checkpoints with peer replicas,
    # from which a restart inside the allocation resumes.
    tuned: bool = False
    async_save: bool = False
    memory_tier: bool = False
    # Live recovery (`ftslurm.agent.live`): a crashed rank is restarted alone, and a lost
    # node's, a hung node's or a benched straggler's place taken by a warm spare, while the
    # other ranks keep their processes; the interrupted step runs again (the LIVE_* costs).
    # Not covered, and so as before: a fault during the start-up or during another
    # recovery, the batch host's loss or hang, more losses than spares, whole-job endings.
    live: bool = False
    # With `live`: the training state is sharded without a replica dimension
    # (`group.attach(replicated=False)`): a rank or node that lost its part cannot receive
    # it from a peer, so every rank is restarted from the memory tier (SHARDED).
    sharded: bool = False
    # The pre-flight health check (`ftslurm.agent.health`, `--health-catch`): the share of a
    # lemon's failures its check at an allocation's start catches (HEALTH_CATCH explains
    # the figure); 0: the checks catch none (the figures before the checks existed).
    health_catch: float = 0.0

    @property
    def in_job_restarts(self) -> int:
        return self.settings.num_in_job_restarts

    @property
    def fast_saves(self) -> bool:
        """Whether its checkpoints block for a snapshot only (async or memory): measured
        against the bound with that w."""
        return self.async_save or self.memory_tier


PLAIN = tool_settings(use_launcher=False)
# submitit resubmits nothing that failed: a crash or a hang killed by the watchdog ends the
# run (a person takes over); Slurm's own requeues (node failure, preemption) go on.
SUBMITIT = tool_settings(
    use_launcher=False, cause_budgets={Cause.CRASH: 0, Cause.HANG: 0, Cause.OOM: 0}
)
NEMO = tool_settings(num_in_job_restarts=NEMO_IN_JOB_RESTARTS)


def spares_for(nodes: int) -> int:
    """How many hot spares the spares policy asks for beside `nodes` active nodes."""
    return max(1, round(SPARE_SHARE * nodes))


def policies(setup: JobSetup = JobSetup(), nodes: int = 0) -> tuple[Policy, ...]:
    """The policies (ftslurm's checkpoint signal lead follows w through the core: the
    daemon reads the save time the job reports); the spares policies ask for
    `spares_for(nodes)` spares. ftslurm's fixed-cadence policies pin the setup's interval
    (the daemon writes that); the tuned ones leave it "auto". Live recovery's intervals
    follow the failures that still need a checkpoint: the product's rule under the
    `live_recovery` setting."""
    fixed = FTSLURM.model_copy(update={"checkpoint_interval": setup.checkpoint_interval_s})
    spares = {"spare_nodes": spares_for(nodes)}
    ftslurm = Policy(
        "ftslurm",
        "ftslurm",
        fixed,
        daemon=True,
        signal=None,
        launcher=True,
        save_on_preempt=True,
        hang_timeout_s=FTSLURM_HANG_TIMEOUT_S + FTSLURM_MONITOR_S,
        startup_hang_timeout_s=FTSLURM_SETUP_TIMEOUT_S + FTSLURM_MONITOR_S,
        crash_detect_s=FTSLURM_MONITOR_S,
        peer_detect=True,
    )
    return (
        Policy(
            "plain",
            "plain requeue",
            PLAIN,
            daemon=False,
            signal=None,
            launcher=False,
            save_on_preempt=False,
            hang_timeout_s=NCCL_WATCHDOG_S,
            startup_hang_timeout_s=NCCL_WATCHDOG_S,
            crash_detect_s=0.0,
        ),
        Policy(
            "submitit",
            "submitit",
            SUBMITIT,
            daemon=False,
            signal=f"USR2@{SUBMITIT_SIGNAL_DELAY_S}",
            launcher=False,
            save_on_preempt=True,
            hang_timeout_s=NCCL_WATCHDOG_S,
            startup_hang_timeout_s=NCCL_WATCHDOG_S,
            crash_detect_s=0.0,
            human_resubmit=True,
        ),
        Policy(
            "nemo",
            "NeMo-Run",
            NEMO,
            daemon=False,
            signal=f"USR2@{NEMO_SIGNAL_LEAD_S}",
            launcher=True,
            save_on_preempt=True,
            hang_timeout_s=NEMO_RANK_HEARTBEAT_S + NVRX_CHECK_INTERVAL_S,
            startup_hang_timeout_s=NEMO_INITIAL_HEARTBEAT_S + NVRX_CHECK_INTERVAL_S,
            crash_detect_s=NVRX_MONITOR_S,
            default_failure_budget=NEMO_JOB_RETRIES_ON_FAILURE,
        ),
        replace(ftslurm, key="ftslurm_slurm", label="ftslurm, Slurm detects", peer_detect=False),
        ftslurm,
        replace(
            ftslurm,
            key="ftslurm_spares",
            label="ftslurm + spares",
            settings=fixed.model_copy(update=spares),
        ),
        replace(
            ftslurm,
            key="ftslurm_async",
            label="ftslurm + async, tuned",
            settings=FTSLURM,
            tuned=True,
            async_save=True,
        ),
        replace(
            ftslurm,
            key="ftslurm_memory",
            label="ftslurm + memory tier, tuned",
            settings=FTSLURM,
            tuned=True,
            memory_tier=True,
        ),
        replace(
            ftslurm,
            key="ftslurm_all",
            label="ftslurm, everything",
            settings=FTSLURM.model_copy(update=spares),
            tuned=True,
            async_save=True,
            memory_tier=True,
        ),
        replace(
            ftslurm,
            key="ftslurm_live",
            label="ftslurm, live recovery",
            settings=FTSLURM.model_copy(update={**spares, "live_recovery": True}),
            tuned=True,
            async_save=True,
            memory_tier=True,
            live=True,
        ),
        replace(
            ftslurm,
            key="ftslurm_live_sharded",
            label="ftslurm, live recovery, sharded state",
            settings=FTSLURM.model_copy(update={**spares, "live_recovery": True}),
            tuned=True,
            async_save=True,
            memory_tier=True,
            live=True,
            sharded=True,
        ),
    )


POLICIES = policies()


class ToolShell(Reconciler):
    """A baseline tool on the same core: its job requeues itself at its ending (the
    `scontrol requeue` of its batch script or signal handler), so the requeue is not held,
    and nothing updates the job's exclusions, releases it or starts it before Slurm's
    requeue delay is over. Every decision is still `step`'s, with the tool's settings."""

    def _execute(
        self,
        backend: SchedulerBackend,
        run: Run,
        a: Attempt,
        intents: list[core.Intent],
        deadlines: list[float],
    ) -> Attempt | None:
        kept = [
            core.Requeue(i.job_id, hold=False) if isinstance(i, core.Requeue) else i
            for i in intents
            if not isinstance(i, core.SetExclusions | core.Release | core.StartNow)
        ]
        return super()._execute(backend, run, a, kept, deadlines)


@dataclass
class Result:
    wall_s: float = 0.0
    productive_s: float = 0.0
    lost_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    counts: dict[str, int] = field(default_factory=dict)
    spare_node_s: float = 0.0  # node-seconds the hot spares were held idle
    # the checkpoint intervals at each start of a tuned policy: (time, memory interval or
    # None, disk interval) as read from the daemon's cadence file
    intervals: list[tuple[float, float | None, float]] = field(default_factory=list)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s else 0.0


class Campaign:
    """One policy replaying one trace on a fresh virtual cluster.

    The orchestration is the product's: a `Reconciler` (ftslurm's daemon, or `ToolShell`
    for a baseline) with its SQLite store decides and acts through `VirtualBackend`, on the
    cluster's virtual clock. The campaign plays the world (the trace's faults, a person
    resubmitting a failed run) and the compute side (the job's progress and checkpoints,
    in-job restarts, hang and crash detection, the files the job writes for the daemon:
    progress.json, the launchers' node reports, the straggler report); it calls no
    scheduler action itself."""

    def __init__(
        self, trace: Trace, pol: Policy, setup: JobSetup = JobSetup(), workdir: Path | None = None
    ) -> None:
        self.trace, self.pol, self.setup = trace, pol, setup
        self._lemon_at: dict[str, list[float]] = {}  # a lemon's failure times (health check)
        for f in trace.faults:
            if f.lemon:
                self._lemon_at.setdefault(f.node, []).append(f.at)
        cfg = MockConfig(
            nodes=[MockNodeSpec(name=n, cpus=1) for n in trace.pool],
            requeue_delay_s=setup.requeue_delay_s,
            slurmd_timeout_s=setup.slurmd_timeout_s,
            kill_wait_s=KILL_WAIT_S,
            min_job_age_s=MIN_JOB_AGE_S,
        )
        self.c = VirtualCluster(cfg, queue_wait_s=setup.queue_wait_s)
        self.job = self._job_model(None)
        signal = pol.signal

        def header(options: JobOptions) -> JobOptions:  # the tool's own sbatch header
            return options if signal is None else replace(options, signal=signal)

        self.backend = VirtualBackend(self.c, self.job, workload=lambda _o: WORKLOAD, amend=header)
        self._tmp = (
            None
            if workdir is not None
            else tempfile.TemporaryDirectory(
                prefix="goodput-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
            )
        )
        self.dir = Path(workdir if workdir is not None else self._tmp.name)  # type: ignore[union-attr]
        self.paths = RunDir(self.dir / "run")
        self.store = Store(self.dir / "state")
        shell = Reconciler if pol.daemon else ToolShell
        self.rec = shell(self.store, lambda _kind: self.backend, clock=lambda: self.c.now)
        self.r = Result()
        self.runs: list[str] = []  # the run ids, oldest first (more after a resubmission)
        self.ended_runs: set[str] = set()  # runs that ended with nobody to submit them again
        self.act_now = False  # the tool's job ended (or a person resubmits): act at once
        self.humans = 0  # resubmissions by hand so far
        self.jid: str | None = None  # the job of the current allocation
        # the current run and allocation
        self.alloc: list[str] = []  # its nodes in node-rank order (node rank 0: batch host)
        self.active: list[str] = []  # the nodes training (the rest are hot spares)
        self.spares: list[str] = []  # idle spares, next to take over first
        self.lost: set[int] = set()  # node ranks of the allocation reported lost
        self.alloc_since: float | None = None  # when the allocation began (None: none)
        self.alloc_until = 0.0  # when its last run ended
        self.alloc_serial = 0
        self.run_serial = 0
        self.run_start = 0.0
        self.restarts_left = 0
        self.restarts_used = 0  # in this allocation
        self.in_job = False  # the next start is an in-job restart
        self.stall: str | None = None  # why the current run is stalled (hung, detection)
        self.last_end = 0.0  # when the last run ended
        self.ended_at: float | None = None  # when the run ended FAILED (human path)
        self.resubmit_at: float | None = None  # when a person resubmits it
        # node state seen by the compute side
        self.slow: dict[str, list[float]] = {}  # node -> slowdowns of its current episodes
        self.persistent: dict[int, list[str]] = {}  # attempt -> its persistent stragglers
        self.env_cache: dict[str, JobEnv] = {}  # a batch script -> its job's environment
        # live recovery: the current run's recoveries as (start, cause, seconds) phases,
        # charged when the run is accounted; the nodes lost under one, not reported yet;
        # the newest recovery (an older one's end is no longer the run's)
        self.live_log: list[tuple[float, str, float]] = []
        self.live_nodes: set[str] = set()
        self.live_serial = 0
        self.c.on_start = self._on_start
        self.c.on_run_end = self._on_run_end
        self.c.on_end = self._on_end
        self.c.plan_start = self._plan_start
        self.run_restart_s = setup.restart_cost_s  # the current run's start-up
        self._submit_run()

    # -------------------------------------------------------------- the job's saves
    def _job_model(self, cadence: Cadence | None) -> JobModel:
        """The job as it checkpoints under this policy: at the fixed interval, or at the
        daemon's `cadence` (a tuned policy; before the daemon has written one, the fixed
        interval for both tiers)."""
        s, pol = self.setup, self.pol
        disk, memory = s.checkpoint_interval_s, None
        if pol.tuned and cadence is not None and cadence.interval_s is not None:
            disk = cadence.tier_interval("disk") or disk
            memory = cadence.interval_s if cadence.disk_interval_s is not None else None
        if pol.memory_tier and memory is None:
            memory = disk
        if not pol.memory_tier:
            memory = None
        return JobModel(
            work_s=10 * self.trace.horizon_s + DAY,
            checkpoint_interval_s=disk,
            checkpoint_cost_s=s.snapshot_s if pol.async_save else s.checkpoint_cost_s,
            restart_cost_s=s.restart_cost_s,
            continue_code=CONTINUE_CODE,
            write_s=s.checkpoint_cost_s if pol.async_save else 0.0,
            memory_interval_s=memory,
            memory_cost_s=s.memory_save_s if pol.memory_tier else 0.0,
            memory_restart_cost_s=s.memory_restart_s if pol.memory_tier else None,
        )

    def _plan_start(self, jid: str, in_job: bool) -> JobModel:
        """At every start the job reads the daemon's checkpoint cadence (a tuned policy), as
        the rank agent does (`ftslurm.agent.rank`)."""
        del jid, in_job  # the same file for every start
        if not self.pol.tuned:
            return self.job
        cadence = Cadence.from_json(read_json(self.paths.cadence))
        self.job = self._job_model(cadence)
        memory, disk = self.job.memory_interval_s, self.job.layout()
        self.r.intervals.append((self.c.now, memory, disk[0] * disk[1]))
        return self.job

    # ------------------------------------------------------------------ driving
    def _submit_run(self) -> None:
        """What `ftslurm submit` does: record the run and its first attempt's intent."""
        run_id = f"r{len(self.runs) + 1}"
        limit = (
            None
            if self.setup.wall_limit_s is None
            else format_limit_exact(int(self.setup.wall_limit_s))
        )
        recipe = Recipe(
            command=["train"],
            nodes=self.trace.nodes,
            time=limit,
            name=WORKLOAD,
            spare_nodes=self.pol.settings.spare_nodes,
        )
        spec = make_spec(
            recipe,
            run_dir=self.paths.root,
            backend="mock",
            workdir=str(self.dir),
            mock_home=self.dir / "mock",
        )
        run, first = new_run_record(run_id, WORKLOAD, spec, self.pol.settings, self.c.now)
        with self.store.transaction():
            self.store.add_run(run)
            self.store.add_attempt(first)
        self.runs.append(run_id)

    def run(self) -> Result:
        for f in self.trace.faults:
            self.c.at(f.at, lambda f=f: self._fault(f))
        horizon = self.trace.horizon_s
        look = 0.0  # the daemon's (or the tool's bookkeeping's) next look
        try:
            while True:
                self.c.run(min(look, horizon), stop=lambda: self.act_now)
                if self.c.now >= horizon:
                    break
                self.act_now = False
                interval = self.rec.cycle()
                self.r.count("daemon_cycles")
                self._after_cycle()
                if self.c.now >= look:
                    look = self._next_look(interval)
            self.c.now = horizon
            self._finish(horizon)
            if self.pol.live:
                self._commit_overhead()
            self.r.wall_s = horizon
            self._tally()
        finally:
            self.store.close()
            if self._tmp is not None:
                self._tmp.cleanup()
        return self.r

    def _next_look(self, interval: float) -> float:
        """The next look, `interval` from now as the daemon asked. At its longest interval
        the daemon's looks between two events decide nothing new (`step` is pure and none of
        its inputs changed; what time alone brings due, it announces as a deadline), so
        those looks are skipped, keeping the daemon's grid: the first look after the next
        event (a scheduler event, a fault, a file the job writes) or deadline is the first
        grid time at or after it."""
        now = self.c.now
        nxt = now + interval
        if interval >= DAEMON_POLL_S:
            quiet = min(self.c.next_event_time(), self.rec.next_deadline or math.inf)
            if quiet > nxt and math.isfinite(quiet):
                nxt = now + math.ceil((quiet - now) / interval) * interval
        return nxt

    def _after_cycle(self) -> None:
        """A person resubmits a run that ended FAILED (the human path), after a delay."""
        run = self.store.get_run(self.runs[-1])
        if run is None or not run.state.is_terminal or self.resubmit_at is not None:
            return
        if not self.pol.human_resubmit or run.state is not RunState.FAILED:
            if run.run_id not in self.ended_runs:  # the run is over: nobody submits again
                self.ended_runs.add(run.run_id)
                self.r.count(f"run_{run.state.value.lower()}")
            return
        now = self.c.now
        delays = self.trace.human_delays_s
        self.ended_at, self.resubmit_at = now, now + delays[self.humans % len(delays)]
        self.humans += 1
        self.r.count("human_resubmits")
        self.c.at(self.resubmit_at, self._resubmit)

    def _resubmit(self) -> None:
        """The person submits the training again: a new run, resuming from its checkpoint."""
        self._submit_run()
        self.act_now = True

    def _tally(self) -> None:
        """What the daemon recorded: the endings by cause, nodes kept out, straggler moves,
        and how often NeMo-Run's default budget would have stopped the run."""
        failed_in_row = 0
        budget = self.pol.default_failure_budget
        for run_id in self.runs:
            for a in self.store.attempts(run_id):
                self.r.count("requeues", int(a.attempt > 0))  # the core's, not by hand
                if a.cause is None:
                    continue  # not ended (the one in flight at the horizon)
                self.r.count(f"cause_{a.cause}")
                if a.cause == Cause.STRAGGLER.value:
                    self.r.count("straggler_moves")
                # NeMo-Run's job-results file: only a clean checkpointed continuation is a
                # success; an attempt killed before its teardown keeps its "X" (a failure)
                failed_in_row = 0 if a.cause == Cause.CHECKPOINTED.value else failed_in_row + 1
                if failed_in_row == budget:
                    self.r.count("over_default_budget")
                    failed_in_row = 0
            for e in self.store.events(run_id):
                if e.kind == "straggler":
                    self.r.count("nodes_excluded", len(e.data.get("nodes") or []))
                    self.r.count("stragglers_flagged")
                elif e.kind == "ended" and e.data.get("cause") != Cause.STRAGGLER.value:
                    self.r.count("nodes_excluded", len(e.data.get("excluded") or []))

    def _spares_held(self, until: float) -> None:
        """Charge the spares of the allocation (idle, held from its start to its last run's
        end, or `until` while a run is in flight)."""
        if self.alloc_since is not None:
            spares = len(self.alloc) - len(self.active)
            self.r.spare_node_s += spares * max(0.0, until - self.alloc_since)
            self.alloc_since = None

    def _finish(self, now: float) -> None:
        """Account the end of the horizon: the run in flight, or the gap since the last."""
        b = self.c.breakdown(self.jid) if self.jid is not None else None
        self._spares_held(now if b is not None else self.alloc_until)
        if b is not None:
            self._account(b, in_flight=True)
            return
        job = self.c.st.jobs.get(self.jid or "")
        if job is not None and job.state is not JobState.RUNNING:  # its memory is gone
            ahead = self.c.memory_ahead_s(job.job_id)
            self.r.productive_s -= ahead
            self._add("lost_work", ahead)
        if self.resubmit_at is not None and self.ended_at is not None:
            self._add("detection", self.ended_at - self.last_end)
            self._add("human", min(now, self.resubmit_at) - self.ended_at)
            self._add("requeue", now - min(now, self.resubmit_at))
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
        # what memory held beyond the disk, counted kept by an earlier run, is lost when
        # this run began in a new allocation
        r.productive_s += (b.computed_s if in_flight else b.saved_s) - b.rolled_back_s
        self._add("lost_work", (0.0 if in_flight else b.computed_s - b.saved_s) + b.rolled_back_s)
        self._add("startup", b.startup_s)
        self._add("checkpoint", b.checkpoint_s)
        self._add("stragglers", b.slow_s)
        # the run stood still for its live recoveries (each phase to its cause, as far as
        # the run got) and otherwise for what stalled it last (a hang, a dead peer)
        live = self._live_charged(b.ended)
        self._add(self.stall if self.stall in CAUSES else "hung", b.stalled_s - sum(live.values()))
        for cause, seconds in live.items():
            self._add(cause, seconds)
        self.live_log = []

    def _live_charged(self, until: float) -> dict[str, float]:
        """The current run's live recoveries up to `until`, per cause."""
        out: dict[str, float] = {}
        for start, cause, seconds in self.live_log:
            out[cause] = out.get(cause, 0.0) + max(0.0, min(start + seconds, until) - start)
        return out

    def _commit_overhead(self) -> None:
        """Live recovery's commit, one store add and wait per step (LIVE_COMMIT_SHARE of the
        compute time): of the time spent computing, kept or lost, that share went to it.
        Charged to "checkpoint", the cost of keeping a state to recover from."""
        f = LIVE_COMMIT_SHARE / (1 + LIVE_COMMIT_SHARE)
        kept, lost = f * self.r.productive_s, f * self.r.lost_s["lost_work"]
        self.r.productive_s -= kept
        self.r.lost_s["lost_work"] -= lost
        self.r.lost_s["checkpoint"] += kept + lost

    # ---------------------------------------------------- what the job writes
    def _attempt(self) -> int:
        """The attempt the job runs as (FTSLURM_ATTEMPT): the one it was submitted as plus
        Slurm's restart count, as its batch script computes it."""
        job = self.c.st.jobs[self.jid or ""]
        return int((job.comment or "::0").rsplit(":", 1)[1]) + job.restart_count

    def _job_env(self) -> JobEnv:
        """The compute side's settings as the daemon gave them to the current job: the
        exports of its batch script (`ftslurm.daemon.submission`), read as the launcher
        reads its environment (the straggler report's interval, threshold and windows;
        what the shell computes at run time, as the attempt, is left out)."""
        job = self.c.st.jobs.get(self.jid or "")
        script = job.script if job is not None else ""
        if script not in self.env_cache:
            env = {}
            for line in script.splitlines():
                if line.startswith("export ") and "=" in line and "$" not in line:
                    key, _, value = line.removeprefix("export ").partition("=")
                    env[key] = " ".join(shlex.split(value))
            self.env_cache[script] = JobEnv.from_environ(env)
        return self.env_cache[script]

    def _write_progress(self) -> None:
        """progress.json as `ftslurm.agent.progress` keeps it: the work saved so far is the
        checkpoint step; the blocking save time is reported with every checkpoint."""
        saved = self.job.work_s - self.c.remaining.get(WORKLOAD, self.job.work_s)
        told: dict[str, Any] = dict(
            step=int(saved), finished=False, attempt=self._attempt(), updated_at=self.c.now
        )
        if saved > 0:
            told.update(checkpoint_step=int(saved), checkpoint_at=self.c.now)
        job = self.job
        if job.checkpoint_cost_s > 0:  # the disk save: what it blocked (async: the snapshot)
            told.update(
                checkpoint_save_s=job.checkpoint_cost_s, max_checkpoint_save_s=job.checkpoint_cost_s
            )
        if job.write_s > 0:  # ... and its background write
            told.update(checkpoint_write_s=job.write_s, max_checkpoint_write_s=job.write_s)
        if job.memory_interval_s is not None and job.memory_cost_s > 0:  # the memory tier
            told.update(memory_step=int(saved), memory_save_s=job.memory_cost_s)
        if self.pol.live and not self.pol.sharded:
            # rank 0 formed a live group and attached a replicated state: it says so
            # (`progress.live_recovery`); a sharded state's cadence stays today's
            told.update(live_recovery=True)
        write_report(self.paths.progress, Progress(**told))

    def _node_report(self, signalled: bool, hung: bool = False) -> int:
        """The launcher's report and exit code when it ends the job (`decide_outcome`, as
        the launcher decides them); without a launcher, the step's own exit code."""
        if not self.pol.launcher:
            return 0 if signalled else 1
        out = decide_outcome(
            succeeded=signalled,
            failures={} if signalled else {0: 1},
            ranks={0},
            stopped={},
            signalled=signalled,
            finished=False,
            max_restarts=self.pol.in_job_restarts,
            hung=hung,
        )
        write_report(
            self.paths.node_report(self._attempt(), 0),
            NodeReport(
                node_rank=0,
                node=self.alloc[0] if self.alloc else "",
                job_id=self.jid,
                attempt=self._attempt(),
                outcome=out.outcome,
                exit_code=int(out.code),
                in_job_restarts=self.restarts_used,
                heartbeats=True,
            ),
        )
        return int(out.code)

    # -------------------------------------------------------------- cluster hooks
    def _on_start(self, jid: str) -> None:
        now = self.c.now
        self.jid = jid
        self.run_serial += 1
        self.run_start = now
        self.stall = None
        run = self.c.runs[jid]
        self.run_restart_s = (run.job or self.c.models[jid]).restart_cost_s
        if self.in_job:
            self.in_job = False
        else:
            self._gap(jid, now)
            self._spares_held(self.alloc_until)  # the last allocation's
            self.alloc = list(self.c.st.jobs[jid].nodes)
            extra = max(0, len(self.alloc) - self.trace.nodes)  # the spares asked for
            self.active, self.spares = (
                self.alloc[: len(self.alloc) - extra],
                self.alloc[len(self.alloc) - extra :],
            )
            self.lost, self.alloc_since = set(), now
            self.live_nodes = set()
            self.alloc_serial += 1
            self.restarts_left = self.pol.in_job_restarts
            self.restarts_used = 0
            self.r.count("allocations")
            self._health_check(now)
            self._write_progress()
            for node in self.active:
                if self.slow.get(node):
                    self._watch_straggler(node, now)
        self._speed()

    def _health_check(self, now: float) -> None:
        """The launchers' pre-flight checks at an allocation's start (HEALTH_CATCH): each
        lemon in it whose next failure would strike within the allocation is caught with
        probability `health_catch` and leaves HEALTH_CHECK_S later as a lost node, before
        any rank trained (the same draw for every policy: seeded by node and time)."""
        if self.pol.health_catch <= 0:
            return
        until = now + (self.setup.wall_limit_s or DAY)
        for node in [*self.active, *self.spares]:
            if node not in self.trace.lemons:
                continue
            soon = any(now <= t < until for t in self._lemon_at.get(node, ()))
            draw = random.Random(f"health/{node}/{now!r}").random()
            if soon and draw < self.pol.health_catch:
                self.r.count("health_caught")
                at = now + HEALTH_CHECK_S
                caught = Fault(at, "node", node, lemon=True)
                self.c.at(at, lambda f=caught: self._fault(f))

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
        self.alloc_until = b.ended
        self.last_end = b.ended
        self.stall = None
        self._write_progress()
        if b.signalled and b.completed:
            self._node_report(signalled=True)  # saved on the signal: "continue me"

    def _on_end(self, jid: str, state: JobState) -> None:
        """The job ended (terminal): a tool's job acts on it at once."""
        self.r.count(f"ended_{state.value.lower()}")
        job = self.c.st.jobs[jid]
        if state is JobState.TIMEOUT or job.exit_code == CONTINUE_CODE:
            self.r.count("wall_limits")  # a continuation (checkpointed) or a wall-limit kill
        if not self.pol.daemon:
            self.act_now = True

    # ----------------------------------------------------------------- the faults
    def _running(self, node: str | None = None) -> bool:
        """Whether the job has a live run (on `node`, when given) that a fault can hit."""
        job = self.c.st.jobs.get(self.jid or "")
        run = self.c.runs.get(self.jid or "")
        return (
            job is not None
            and job.state is JobState.RUNNING
            and run is not None
            and run.saved_on_exit is None
            and (node is None or node in self.active)
        )

    def _fault(self, f: Fault) -> None:
        st, now = self.c.st, self.c.now
        n = st.nodes[f.node]
        usable = n.status is NodeStatus.UP and n.dead_since is None
        job = st.jobs.get(self.jid or "")
        on_job = (
            job is not None
            and f.node in job.nodes
            and job.state in (JobState.RUNNING, JobState.COMPLETING)
        )
        if f.kind == "straggler":
            self.slow.setdefault(f.node, []).append(f.slowdown)
            self.c.at(now + f.duration_s, lambda: self._straggler_over(f))
            if on_job and f.node in self.active:  # an idle spare slows nobody
                self._speed()
                self._watch_straggler(f.node, now)
            return
        if f.kind in ("node", "maintenance") and not usable:
            return  # already out of service
        if f.kind == "node":
            active = on_job and f.node in self.active
            if active and self.jid in self.c.runs:
                self.r.count("hit_lemon" if f.lemon else "hit_node_failure")
            # live recovery: the survivors keep their processes (they wait in a collective
            # until the launchers report the node lost), a warm spare takes its place
            live = (
                active and self.pol.peer_detect and self._live_ready() and self._spare_helps(f.node)
            )
            self.c.fail_node(f.node, idle=(on_job and not active) or live)  # a spare runs no rank
            self.c.at(now + REPAIR_S, lambda: model.revive_node(st, f.node))
            if on_job and self.pol.peer_detect:
                alloc = self.alloc_serial
                self.c.at(now + PEER_DETECT_S, lambda: self._peer_lost(f.node, alloc))
            if live:
                self.live_nodes.add(f.node)
                seen = ("detection", PEER_DETECT_S)
                if self.pol.sharded:  # the spare's ranks lack the node's part: every rank
                    self._live_given_up("node", seen, ("startup", LIVE_SHARDED_SPARE_S))
                else:
                    self._live("node", seen, ("startup", LIVE_SPARE_RECOVERY_S))
            return
        if f.kind == "maintenance":
            if on_job and job is not None and job.state is JobState.RUNNING:
                self.r.count("hit_preemption")
                self.c.preempt(job.job_id, PREEMPT_GRACE_S, self.pol.save_on_preempt)
            model.drain_node(st, f.node, "maintenance")
            self.c.at(now + MAINTENANCE_S, lambda: model.revive_node(st, f.node))
            return
        if not self._running(f.node) or self.stall is not None:
            return
        self.r.count(f"hit_{f.kind}")
        if f.kind == "hang" and self._live_ready() and self._spare_helps(f.node):
            # `launch_core.on_hang`: when its hang timeout fires, the hung node's launcher
            # steps out (not the batch host, a spare left: `may_step_out`), kills its ranks
            # and writes its bench record; the survivors' collectives fail at once and a
            # warm spare takes its ranks over, as for a straggler. No in-job restart used.
            self._bench(f.node, "hang")
            self._take_spare(f.node)
            seen = ("hung", self.pol.hang_timeout_s)
            if self.pol.sharded:
                self._live_given_up("hang", seen, ("startup", LIVE_SHARDED_SPARE_S))
            else:
                self._live("hang", seen, ("startup", LIVE_SPARE_RECOVERY_S))
            return
        if f.kind == "crash" and self._live_ready() and self.restarts_left > 0:
            # the launcher restarts the rank alone, the others wait; like the product's
            # restart alone, it uses one of the allocation's in-job restarts
            self.restarts_left -= 1
            self.restarts_used += 1
            seen = ("detection", self.pol.crash_detect_s)
            if self.pol.sharded:  # it joins, lacks its part: every rank is restarted
                self._live_given_up("crash", seen, ("startup", LIVE_SHARDED_RANK_S), spend=True)
            else:
                self._live(f.kind, seen, ("startup", LIVE_RANK_RECOVERY_S))
            return
        if f.kind == "crash":
            if self.restarts_left > 0:
                self._stall("detection")
                self._later(self.pol.crash_detect_s, self._recover)
            else:
                self._give_up(hung=False)  # the step fails (srun --kill-on-bad-exit)
        elif f.kind == "hang":
            self._stall("hung")
            startup = now - self.run_start < self.run_restart_s
            wait = self.pol.startup_hang_timeout_s if startup else self.pol.hang_timeout_s
            if self.pol.live and self.pol.settings.spare_nodes and not startup:
                # `launch_core.on_hang` with spares, the node unable to step out (the batch
                # host, no spare left): it looks at its rank (FROZEN_LOOK_S), waits for the
                # other nodes' claims (HANG_CLAIM_WAIT_S), then BENCH_WAIT_S for a peer to
                # step out, then every rank restarts in place (from the memory tier)
                wait += FROZEN_LOOK_S + HANG_CLAIM_WAIT_S + BENCH_WAIT_S
            self._later(wait, lambda: self._recover(hung=True))

    def _peer_lost(self, node: str, alloc: int) -> None:
        """The launchers' verdict on a node silent since it died (`ftslurm.agent.peers`):
        the report the daemon reads (`RunDir.peer_lost`), and with a spare left the
        survivors take it in and restart the ranks inside the job, from the checkpoint,
        after the same rule the daemon follows (`ftslurm.core.recovery`); otherwise the
        daemon ends the job and the run goes on in a new one without the node."""
        job = self.c.st.jobs.get(self.jid or "")
        if alloc != self.alloc_serial or job is None or job.state is not JobState.RUNNING:
            return
        now, attempt, rank = self.c.now, self._attempt(), self.alloc.index(node)
        by = (rank - 1) % len(self.alloc)  # its watcher in ring order
        self.lost.add(rank)
        write_report(
            self.paths.peer_lost(attempt, rank),
            PeerLost(
                lost_node_rank=rank,
                lost_node=node,
                last_heard=now - PEER_DETECT_S,
                lease_time=now - PEER_DETECT_S,
                silent_s=PEER_DETECT_S,
                peer_timeout_s=self.pol.settings.peer_timeout_s,
                reported_by=self.alloc[by],
                reported_by_node_rank=by,
                time=now,
                job_id=self.jid,
                attempt=attempt,
            ),
        )
        self.r.count("peer_reports")
        live = node in self.live_nodes and self.jid in self.c.runs
        self.live_nodes.discard(node)
        if node in self.spares:  # an idle spare: one fewer to take over
            self.spares.remove(node)
        elif live and self._spare_helps(node):
            self._take_spare(node)  # live recovery: the ranks that wait take a spare in
        elif live:  # the spare went meanwhile: the round cannot form, the daemon ends the job
            self.live_serial += 1
            self._stall("detection")
        elif self._spare_helps(node):
            self._swap(node)
        # else the daemon ends the job: a new one runs without the node

    def _spare_helps(self, node: str) -> bool:
        """Whether a spare can take `node`'s place (`ftslurm.core.recovery`, counting the
        nodes already out of this allocation)."""
        rank = self.alloc.index(node)
        return (
            node in self.active
            and bool(self.spares)
            and recovery(self.lost | {rank}, self.pol.settings.spare_nodes) is Recovery.SPARE
        )

    def _swap(self, node: str) -> None:
        """The launchers restart the ranks inside the allocation with a spare in `node`'s
        place, from the last checkpoint (the restart cost u0; no requeue, no queue)."""
        now = self.c.now
        self._take_spare(node)
        self.r.count("in_job_restarts")
        if self.jid not in self.c.runs:  # its ranks died with the node: nobody trained since
            self._add("detection", now - self.last_end)
        self.in_job = True
        self.c.restart_in_job(self.jid or "")  # from memory with a memory tier

    def _take_spare(self, node: str) -> None:
        """The next idle spare takes `node`'s place among the active nodes."""
        self.lost.add(self.alloc.index(node))
        self.active[self.active.index(node)] = self.spares.pop(0)
        self.r.count("spare_swaps")

    def _stall(self, why: str) -> None:
        self.stall = why
        self.c.set_speed(self.jid or "", 0.0)

    # ----------------------------------------------------------- live recovery
    def _live_ready(self) -> bool:
        """Whether live recovery serves a fault now: the policy has it, the run trains
        (past its start-up, not saving on a signal) and no other recovery is under way."""
        return (
            self.pol.live
            and self._running()
            and self.stall is None
            and self.c.now - self.run_start >= self.run_restart_s
        )

    def _live(self, kind: str, *phases: tuple[str, float]) -> None:
        """A live recovery of a `kind` fault starts now: the run stands still for `phases`
        (cause, seconds), then for the step the fault interrupted, which runs again, and
        trains on."""
        now = self.c.now
        self._stall("live")
        t = now
        for cause, seconds in (*phases, ("lost_work", LIVE_REDONE_S)):
            self.live_log.append((t, cause, seconds))
            t += seconds
        self.live_serial += 1
        serial = self.live_serial
        self.r.count("live_recoveries")
        self.r.count(f"live_{kind}")
        self._later(t - now, lambda: self._live_done(serial))

    def _live_given_up(self, kind: str, *phases: tuple[str, float], spend: bool = False) -> None:
        """A live recovery of a `kind` fault under a sharded state: the run stands still for
        `phases` (the detection, the re-formation with the rank or the spare that lacks its
        part), every rank gives up (SHARDED) and the launcher restarts every rank from the
        memory tier: an in-job restart (`spend`: one more of the allocation's, as a rank's
        exit after its restart alone; a spare's take-over uses none, as a spare swap)."""
        now = self.c.now
        self._stall("live")
        t = now
        for cause, seconds in phases:
            self.live_log.append((t, cause, seconds))
            t += seconds
        self.live_serial += 1
        serial = self.live_serial
        self.r.count("live_given_up")
        self.r.count(f"live_given_up_{kind}")

        def restart() -> None:
            if serial != self.live_serial or self.stall != "live":
                return
            if spend:
                self._recover()
                return
            self.r.count("in_job_restarts")
            self.in_job = True
            self.c.restart_in_job(self.jid or "")  # from memory with a memory tier

        self._later(t - now, restart)

    def _live_done(self, serial: int) -> None:
        if serial != self.live_serial or self.stall != "live":
            return
        self.stall = None
        self._speed()

    def _step_out(self, node: str, alloc: int) -> None:
        """A persistent straggler's launcher steps out at a step boundary (live recovery):
        a warm spare takes its place, the ranks keep their processes. Under another
        recovery (or a start-up) it waits a step more."""
        if alloc != self.alloc_serial or not self._running(node) or not self._spare_helps(node):
            return
        if not self._live_ready():
            self.c.at(self.c.now + STEP_S, lambda: self._step_out(node, alloc))
            return
        self._bench(node)
        self._take_spare(node)
        if self.pol.sharded:
            self._live_given_up("straggler", ("startup", LIVE_SHARDED_SPARE_S))
        else:
            self._live("straggler", ("startup", LIVE_SPARE_RECOVERY_S))

    def _later(self, delay: float, action: Callable[[], None]) -> None:
        """Run `action` after `delay` if the current run is still the same then."""
        serial = self.run_serial
        self.c.at(
            self.c.now + delay,
            lambda: action() if serial == self.run_serial and self.jid in self.c.runs else None,
        )

    def _recover(self, hung: bool = False) -> None:
        """The launcher (or the watchdog) acts on a dead or hung rank."""
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self.restarts_used += 1
            self.r.count("in_job_restarts")
            self.in_job = True
            self.c.restart_in_job(self.jid or "")  # from memory with a memory tier
        else:
            self._give_up(hung)

    def _give_up(self, hung: bool) -> None:
        """The job's processes exit: the launcher's verdict, or the failed step's code."""
        self.c.end_processes(self.jid or "", self._node_report(signalled=False, hung=hung))

    def _speed(self) -> None:
        if self.stall is not None or self.jid not in self.c.runs:
            return
        worst = max((max(self.slow[n]) for n in self.active if self.slow.get(n)), default=1.0)
        self.c.set_speed(self.jid or "", 1.0 / worst)

    def _straggler_over(self, f: Fault) -> None:
        self.slow[f.node].remove(f.slowdown)
        self._speed()

    # ------------------------------------------- the straggler report (compute side)
    def _watch_straggler(self, node: str, since: float) -> None:
        """Where the run reports stragglers (ftslurm's launcher on node 0 scores the ranks'
        step times every report interval): a node below the threshold for
        `straggler_windows` full windows is named persistent in the report."""
        s = self.pol.settings
        if not (self.pol.launcher and (s.exclude_stragglers or s.stop_if_straggler)):
            return  # nothing scores the ranks
        env = self._job_env()  # what the daemon gave the launchers
        interval = env.straggler_interval_s
        due = (math.floor(since / interval) + 1 + env.straggler_windows) * interval
        alloc = self.alloc_serial
        self.c.at(due, lambda: self._straggler_due(node, alloc))

    def _straggler_due(self, node: str, alloc: int) -> None:
        slow = self.slow.get(node)
        if alloc != self.alloc_serial or not slow or not self._running(node):
            return
        score = 1.0 / max(slow)
        threshold = self._job_env().straggler_threshold  # the rule's, through the daemon
        if score >= threshold:
            return  # not slow enough to score below the threshold
        attempt = self._attempt()
        nodes = self.persistent.setdefault(attempt, [])
        if node in nodes:
            return
        nodes.append(node)
        write_report(
            self.paths.straggler_report,
            StragglerReport(
                attempt=attempt,
                threshold=threshold,
                persistent_nodes=list(nodes),
                updated_at=self.c.now,
                scores=[
                    StragglerScore(
                        node=n, relative=1.0 / max(self.slow.get(n) or [1.0]), individual=1.0
                    )
                    for n in nodes
                ],
            ),
        )
        rank = self.alloc.index(node)
        if rank != 0 and self._spare_helps(node):  # its launcher steps out for a spare
            if self.pol.live:  # at a step boundary, a few (slow) steps on
                out = self.c.now + LIVE_STEP_OUT_STEPS * STEP_S * max(slow)
                self.c.at(out, lambda: self._step_out(node, alloc))
                return
            self._bench(node)
            self._swap(node)

    def _bench(self, node: str, why: str = "straggler") -> None:
        """A node's launcher steps out (a straggler, or a hung node under live recovery):
        its report for the daemon."""
        attempt, rank = self._attempt(), self.alloc.index(node)
        write_report(
            self.paths.benched(attempt, rank),
            Benched(
                node_rank=rank,
                node=node,
                why=why,
                time=self.c.now,
                job_id=self.jid,
                attempt=attempt,
            ),
        )
        self.r.count("straggler_swaps" if why == "straggler" else f"{why}_step_outs")


# ----------------------------------------------------------------------- reporting
def simulate(
    seed: int,
    sizes: list[int],
    days: float,
    fm: FailureModel = FailureModel(),
    setup: JobSetup = JobSetup(),
    queue_waits: tuple[float, ...] = (0.0,),
    keys: tuple[str, ...] | None = None,
    health_catch: float = 0.0,
) -> dict[str, Any]:
    """Per size one trace, replayed under every policy (or those of `keys`) for each queue
    wait q. A policy that saves asynchronously or to memory is measured against the bound
    with that w ("x today" against "async")."""
    results: dict[str, Any] = {}
    for size in sizes:
        trace = draw_trace(seed, size, days, fm)
        runs: list[dict[str, Any]] = []
        for q in queue_waits:
            s = replace(setup, queue_wait_s=q)
            bnd = bounds(trace, s)
            per: dict[str, Any] = {}
            for pol in policies(s, size):
                if keys is not None and pol.key not in keys:
                    continue
                if pol.daemon and pol.launcher:  # ftslurm's launchers run the health check
                    pol = replace(pol, health_catch=health_catch)
                started = time.perf_counter()
                res = Campaign(trace, pol, s).run()
                own = bnd["async" if pol.fast_saves else "today"]["ettr"]
                own_strict = bnd["strict_async" if pol.fast_saves else "strict"]["ettr"]
                per[pol.key] = {
                    "label": pol.label,
                    "ettr": res.ettr,
                    "ratio_to_bound": res.ettr / own,
                    "ratio_to_strict": res.ettr / own_strict,
                    "wall_s": res.wall_s,
                    "productive_s": res.productive_s,
                    "lost_s": dict(res.lost_s),
                    "counts": dict(sorted(res.counts.items())),
                    "spare_nodes": pol.settings.spare_nodes,
                    "spare_node_hours": res.spare_node_s / HOUR,
                    "intervals": _intervals(res.intervals),
                    "sim_s": time.perf_counter() - started,
                }
            runs.append({"queue_wait_s": q, "bounds": bnd, "policies": per})
        results[str(size)] = {"trace": trace.facts(), "runs": runs}
    return results


def _intervals(seen: list[tuple[float, float | None, float]]) -> dict[str, Any] | None:
    """A tuned policy's checkpoint intervals: at its first and last start and how often
    they changed (None: a fixed cadence)."""
    if not seen:
        return None
    (_, memory0, disk0), (_, memory1, disk1) = seen[0], seen[-1]
    changes = sum(1 for a, b in zip(seen, seen[1:], strict=False) if a[1:] != b[1:])
    return {
        "starts": len(seen),
        "changes": changes,
        "first_memory_s": memory0,
        "first_disk_s": disk0,
        "last_memory_s": memory1,
        "last_disk_s": disk1,
    }


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
    fm = FailureModel(
        failures_per_node_day=CALIBRATION_FAILURES_PER_NODE_DAY,
        share_crash=1.0,
        share_hang=0.0,
        lemon_fraction=0.0,
        lemon_share=0.0,
        planned_per_node_day=0.0,
        straggler_episodes_per_node_day=0.0,
    )
    setup = JobSetup(
        checkpoint_interval_s=interval_s,
        checkpoint_cost_s=0.0,
        restart_cost_s=CALIBRATION_RESTART_S,
        queue_wait_s=0.0,
        wall_limit_s=None,
        requeue_delay_s=0,
    )
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
        rows.append(
            {
                "interval_s": interval,
                "simulated": res.ettr,
                "paper": paper,
                "formula": kokolis_ettr(lam, CALIBRATION_RESTART_S, interval),
                "renewal": renewal_ettr(lam, CALIBRATION_RESTART_S, interval),
                "failures_hit": res.counts.get("hit_crash", 0),
                "ok": abs(res.ettr - paper) <= CALIBRATION_TOLERANCE,
            }
        )
    return rows


def print_calibration(rows: list[dict[str, Any]], seed: int, days: float) -> None:
    print(
        f"Calibration: plain requeue, {CALIBRATION_NODES} nodes, r_f = "
        f"{1000 * CALIBRATION_FAILURES_PER_NODE_DAY:g}/1000 node-days, u0 = "
        f"{CALIBRATION_RESTART_S:.0f} s, w = 0, q = 0; {days:g} days, seed {seed}"
    )
    print(
        f"{'interval':>9} {'simulated':>9} {'paper':>6} {'off':>6} {'formula':>8} "
        f"{'renewal':>8} {'failures':>8}"
    )
    for r in rows:
        print(
            f"{r['interval_s'] / 60:>7.0f} m {r['simulated']:>9.3f} {r['paper']:>6.2f} "
            f"{r['simulated'] - r['paper']:>+6.3f} {r['formula']:>8.3f} {r['renewal']:>8.3f} "
            f"{r['failures_hit']:>8}  {'ok' if r['ok'] else 'OFF'}"
        )
    print(
        f"(fails beyond +-{CALIBRATION_TOLERANCE}; formula: Kokolis' first-order "
        "(1 - lam (u0 + dt/2)); renewal: the exact expectation of the same model)"
    )


def assumptions() -> dict[str, Any]:
    names = (
        "FAILURES_PER_NODE_DAY",
        "SHARE_CRASH",
        "SHARE_HANG",
        "SHARE_NODE",
        "LEMON_FRACTION",
        "LEMON_SHARE",
        "HEALTHY_NODE_FAILURES_PER_NODE_DAY",
        "LEMON_NODE_FAILURES_PER_NODE_DAY",
        "REPAIR_S",
        "PLANNED_PER_NODE_DAY",
        "PREEMPT_GRACE_S",
        "MAINTENANCE_S",
        "STRAGGLER_EPISODES_PER_NODE_DAY",
        "STRAGGLER_DURATION_S",
        "STRAGGLER_SLOWDOWN",
        "SPARE_FRACTION",
        "CHECKPOINT_INTERVAL_S",
        "CHECKPOINT_COST_S",
        "RESTART_COST_S",
        "STEP_S",
        "ASYNC_SNAPSHOT_S",
        "MEMORY_SAVE_S",
        "MEMORY_RESTART_COST_S",
        "WALL_LIMIT_S",
        "SLURMD_TIMEOUT_S",
        "REQUEUE_DELAY_S",
        "KILL_WAIT_S",
        "NCCL_WATCHDOG_S",
        "SUBMITIT_SIGNAL_DELAY_S",
        "HUMAN_RESUBMIT_MEDIAN_S",
        "HUMAN_RESUBMIT_SIGMA",
        "NEMO_RANK_HEARTBEAT_S",
        "NEMO_INITIAL_HEARTBEAT_S",
        "NEMO_IN_JOB_RESTARTS",
        "NEMO_JOB_RETRIES_ON_FAILURE",
        "NEMO_SIGNAL_LEAD_S",
        "FTSLURM_HANG_TIMEOUT_S",
        "FTSLURM_SETUP_TIMEOUT_S",
        "FTSLURM_SIGNAL_LEAD_S",
        "DAEMON_POLL_S",
        "LIVE_CRASH_MEASURED_S",
        "LIVE_BENCH_STEP_S",
        "LIVE_RANK_RESTART_S",
        "LIVE_COMMIT_S",
        "LIVE_COMMIT_SHARE",
        "LIVE_RANK_SETUP_S",
        "LIVE_REFORM_S",
        "MODEL_PARAMS",
        "STATE_BYTES_PER_PARAM",
        "NODES_PER_REPLICA",
        "GPUS_PER_NODE",
        "STATE_BANDWIDTH_BPS",
        "LIVE_NODE_TRANSFER_S",
        "LIVE_RANK_TRANSFER_S",
        "LIVE_RANK_RECOVERY_S",
        "LIVE_SPARE_RECOVERY_S",
        "LIVE_REDONE_S",
        "LIVE_STEP_OUT_STEPS",
    )
    g = globals()
    out: dict[str, Any] = {n: g[n] for n in names}
    out["FTSLURM_EXCLUSION_TTL_S"] = FTSLURM.node_exclusion_ttl_s
    out["FTSLURM_EXCLUSION_MAX_TTL_S"] = FTSLURM.node_exclusion_max_ttl_s
    out["FTSLURM_STRAGGLER"] = {
        "interval_s": FTSLURM.straggler_report_interval_s,
        "windows": FTSLURM.straggler_windows,
        # the product's rule (`ftslurm.core.settings.straggler_threshold`): the setting is
        # left at its default (None); live recovery with spares gets the sensitive one
        "threshold": straggler_threshold(
            FTSLURM.straggler_threshold,
            live_recovery=FTSLURM.use_launcher and FTSLURM.live_recovery,
            spare_nodes=FTSLURM.spare_nodes if FTSLURM.use_launcher else 0,
        ),
        "threshold_live": straggler_threshold(
            FTSLURM.straggler_threshold, live_recovery=True, spare_nodes=1
        ),
    }
    return out


def _pct(x: float, wall: float) -> str:
    return f"{100 * x / wall:.1f}" if wall else "-"


def _q(run: dict[str, Any]) -> str:
    return f"q = {run['queue_wait_s'] / 60:g} min"


EVENT_COLUMNS = (
    ("allocations", "starts"),
    ("hit_node_failure", "node fail"),
    ("hit_lemon", "lemon fail"),
    ("hit_crash", "crash"),
    ("hit_hang", "hang"),
    ("hit_preemption", "preempt"),
    ("wall_limits", "wall limit"),
    ("in_job_restarts", "in-job restart"),
    ("spare_swaps", "spare swap"),
    ("live_recoveries", "live recovery"),
    ("live_given_up", "live given up"),
    ("peer_reports", "peer report"),
    ("straggler_moves", "straggler move"),
    ("nodes_excluded", "excluded"),
    ("human_resubmits", "by hand"),
    ("over_default_budget", "default stop"),
)


def print_tables(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    for size, entry in out["results"].items():
        tr = entry["trace"]
        faults = ", ".join(
            f"{v} {k.replace('_', ' ')}" for k, v in sorted(tr["faults_in_pool"].items())
        )
        for run in entry["runs"]:
            b, st = run["bounds"]["today"], run["bounds"]["strict"]
            fa = run["bounds"]["async"]
            caption = (
                f"today's bound {b['ettr']:.3f}: lam = {b['failures_per_day']:.2f}/day "
                f"(lemons left out), Young/Daly {b['interval_s'] / 60:.0f} min, u0 = "
                f"{b['restart_s']:.0f} s, w = {b['checkpoint_cost_s']:.0f} s; with "
                f"w = {fa['checkpoint_cost_s']:g} s (async, memory: their 'x today') "
                f"{fa['ettr']:.3f} at {fa['interval_s'] / 60:.0f} min\n"
                f"strict bound {st['ettr']:.3f}: lam = {st['failures_per_day']:.2f}/day "
                f"(whole fleet), Young/Daly {st['interval_s'] / 60:.0f} min, u0 = 0\n"
                f"trace: {tr['pool_nodes']} nodes in the pool ({tr['lemon_nodes']} "
                f"lemons): {faults}"
            )
            t = Table(
                title=f"{size} nodes, {out['days']:g} days, seed {out['seed']}, "
                f"{_q(run)}: ETTR, and the rest of the wall time by cause (%)",
                caption=caption,
            )
            t.add_column("policy", no_wrap=True)
            t.add_column("ETTR", justify="right")
            t.add_column("x today", justify="right")
            t.add_column("x strict", justify="right")
            for cause in CAUSES:
                t.add_column(CAUSE_LABELS[cause], justify="right")
            for p in run["policies"].values():
                t.add_row(
                    p["label"],
                    f"{p['ettr']:.3f}",
                    f"{p['ratio_to_bound']:.3f}",
                    f"{p['ratio_to_strict']:.3f}",
                    *(_pct(p["lost_s"][k], p["wall_s"]) for k in CAUSES),
                )
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
                t.add_row(
                    size if i == j == 0 else "",
                    f"{run['queue_wait_s']:g} s" if i == 0 else "",
                    p["label"],
                    *(str(p["counts"].get(k, 0)) for k, _ in EVENT_COLUMNS),
                    end_section=i == len(pols) - 1,
                )
    console.print(t)
    console.print(
        f"simulated {len(out['results'])} sizes x {len(out['queue_waits_s'])} queue "
        f"waits x {len(out['policies'])} policies x {out['days']:g} days in "
        f"{out['elapsed_s']:.1f} s"
    )
    for line in spare_lines(out):
        console.print(f"spares: {line}")
    for line in cadence_lines(out):
        console.print(f"cadence: {line}")
    for note in out["checks"]:
        console.print(f"check: {note}")


def markdown(out: dict[str, Any]) -> str:
    """The summary table of docs/performance.md."""
    keys = list(out["policies"])
    head = (
        ["nodes", "q"]
        + [out["policies"][k] for k in keys]
        + ["today's bound", "strict bound", "today's, async w", "strict, async w"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for size, entry in out["results"].items():
        for run in entry["runs"]:
            cells = [size, f"{run['queue_wait_s'] / 60:g} min"]
            cells += [
                f"{p['ettr']:.3f} ({p['ratio_to_bound']:.3f})"
                for p in (run["policies"][k] for k in keys)
            ]
            cells += [
                f"{run['bounds'][b]['ettr']:.3f}"
                for b in ("today", "strict", "async", "strict_async")
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"- {line}" for line in spare_lines(out))]
    return "\n".join(lines)


def spare_lines(out: dict[str, Any]) -> list[str]:
    """The spares' cost (idle node-hours) beside their gain (productive node-hours over
    ftslurm without spares), per size and q."""
    lines = []
    for size, entry in out["results"].items():
        for run in entry["runs"]:
            pols = run["policies"]
            spares, base = pols.get("ftslurm_spares"), pols.get("ftslurm")
            if spares is None or base is None:
                continue
            gain = (spares["ettr"] - base["ettr"]) * spares["wall_s"] / HOUR * int(size)
            lines.append(
                f"{size} nodes, {_q(run)}: {spares['spare_nodes']} hot spare(s) held "
                f"{spares['spare_node_hours']:.0f} idle node-hours; they gained "
                f"{gain:.0f} productive node-hours "
                f"({100 * (spares['ettr'] - base['ettr']):+.1f} ETTR points) over "
                "ftslurm without spares"
            )
    return lines


def cadence_lines(out: dict[str, Any]) -> list[str]:
    """Per tuned policy, size and q: the intervals the daemon tuned, at the first start
    that had its file and at the last (the failure history moves them)."""
    lines = []
    for size, entry in out["results"].items():
        for run in entry["runs"]:
            for p in run["policies"].values():
                iv = p.get("intervals")
                if not iv:
                    continue
                first, last = (
                    f"{_span(iv[f'{k}_memory_s'])}/{_span(iv[f'{k}_disk_s'])}"
                    for k in ("first", "last")
                )
                lines.append(
                    f"{size} nodes, {_q(run)}, {p['label']}: memory/disk interval "
                    f"{first} at the first start, {last} at the last "
                    f"({iv['starts']} starts, {iv['changes']} changes)"
                )
    return lines


def _span(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


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
            notes.append(
                f"{size} nodes, {_q(run)}: highest ETTR {best}; "
                + (f"ABOVE today's bound: {', '.join(over)}" if over else "all below today's bound")
                + "; "
                + (
                    f"ABOVE the strict bound: {', '.join(over_strict)}"
                    if over_strict
                    else "all below the strict bound"
                )
            )
    if len(sizes) > 1 and "plain" in out["policies"]:
        plain = [out["results"][s]["runs"][0]["policies"]["plain"]["ettr"] for s in sizes]
        falls = all(a >= b for a, b in zip(plain, plain[1:], strict=False))
        notes.append(
            f"plain requeue ETTR by size {' > '.join(f'{x:.3f}' for x in plain)}: "
            + ("falls with size" if falls else "does NOT fall monotonically")
        )
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
        ax1.hlines(
            first[s]["bounds"]["today"]["ettr"],
            j - 0.45,
            j + 0.45,
            colors="black",
            linestyles="dashed",
            label="today's bound" if j == 0 else None,
        )
        ax1.hlines(
            first[s]["bounds"]["strict"]["ettr"],
            j - 0.45,
            j + 0.45,
            colors="grey",
            linestyles="dotted",
            label="strict bound" if j == 0 else None,
        )
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
    parser.add_argument(
        "--failure-rate",
        type=float,
        default=1000 * FAILURES_PER_NODE_DAY,
        help="unexpected interruptions per 1000 node-days, fleet average "
        "(lemons included); default Llama 3's 3.79",
    )
    parser.add_argument(
        "--lemon-share",
        type=float,
        default=LEMON_SHARE,
        help="share of the hardware failures carried by the lemon nodes "
        f"({100 * LEMON_FRACTION:g}%% of the pool); default 10/14",
    )
    parser.add_argument(
        "--health-catch",
        type=float,
        default=0.0,
        help="share of a lemon's failures ftslurm's pre-flight health check catches at an "
        f"allocation's start (0: none, the published tables; {HEALTH_CATCH:g}: the assumed "
        "share, HEALTH_CATCH)",
    )
    parser.add_argument(
        "--straggler-rate",
        type=float,
        default=STRAGGLER_EPISODES_PER_NODE_DAY,
        help="fail-slow episodes per node-day",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=CHECKPOINT_INTERVAL_S,
        help="checkpoint interval in seconds (of compute)",
    )
    parser.add_argument(
        "--checkpoint-write",
        type=float,
        default=CHECKPOINT_COST_S,
        help="w: blocking checkpoint write in seconds",
    )
    parser.add_argument(
        "--restart",
        type=float,
        default=RESTART_COST_S,
        help="u0: start-up plus checkpoint load in seconds, at every start",
    )
    parser.add_argument(
        "--snapshot",
        type=float,
        default=ASYNC_SNAPSHOT_S,
        help="what an asynchronous disk save blocks, in seconds (its write, "
        "--checkpoint-write, goes on in the background)",
    )
    parser.add_argument(
        "--memory-save",
        type=float,
        default=MEMORY_SAVE_S,
        help="what a memory-tier save blocks, in seconds",
    )
    parser.add_argument(
        "--memory-restart",
        type=float,
        default=MEMORY_RESTART_COST_S,
        help="start-up plus restore from memory in seconds (in-job restarts "
        "of the memory-tier policies)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(p.key for p in POLICIES),
        help="comma-separated policy keys to simulate (default: all)",
    )
    parser.add_argument(
        "--queue-wait",
        default="0,600",
        help="q: seconds each requeue waits for nodes held by other jobs, "
        "comma-separated for several runs",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="reproduce Kokolis et al. for plain requeue (exit 1 if off)",
    )
    parser.add_argument("--plot", default="goodput.png", help="PNG to write ('' for none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--markdown", action="store_true", help="print the summary table of docs/performance.md"
    )
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
    if not 0 <= args.health_catch <= 1:
        parser.error("--health-catch is a share between 0 and 1")
    if not 0 < args.interval < math.inf:
        parser.error("--interval must be a positive number of seconds")
    for flag in ("snapshot", "memory_save", "memory_restart"):
        if not 0 < getattr(args, flag) < math.inf:
            parser.error(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    known = [p.key for p in POLICIES]
    args.policies = tuple(k.strip() for k in args.policies.split(",") if k.strip())
    unknown = [k for k in args.policies if k not in known]
    if unknown or not args.policies:
        parser.error(
            f"--policies takes keys among {','.join(known)}; got {','.join(unknown) or 'none'}"
        )
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
    fm = FailureModel(
        failures_per_node_day=args.failure_rate / 1000,
        lemon_share=args.lemon_share,
        straggler_episodes_per_node_day=args.straggler_rate,
    )
    setup = JobSetup(
        checkpoint_interval_s=args.interval,
        checkpoint_cost_s=args.checkpoint_write,
        restart_cost_s=args.restart,
        snapshot_s=args.snapshot,
        memory_save_s=args.memory_save,
        memory_restart_s=args.memory_restart,
    )
    started = time.perf_counter()
    results = simulate(
        args.seed,
        args.sizes,
        args.days,
        fm,
        setup,
        args.queue_wait,
        args.policies,
        health_catch=args.health_catch,
    )
    out: dict[str, Any] = {
        "seed": args.seed,
        "days": args.days,
        "sizes": args.sizes,
        "queue_waits_s": list(args.queue_wait),
        "failure_model": asdict(fm),
        "job_setup": asdict(setup),
        "policies": {p.key: p.label for p in POLICIES if p.key in args.policies},
        "causes": list(CAUSES),
        "results": results,
        "elapsed_s": time.perf_counter() - started,
        "assumptions": assumptions(),
    }
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
