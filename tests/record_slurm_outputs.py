"""Record a Slurm release's answers for the parser tests (tests/data/*_<version>.txt).

    python tests/record_slurm_outputs.py --version 24.11

runs one fixed set of jobs on that release's local cluster (which must be up and idle:
`python -m ftslurm.localcluster --version 24.11 up`) and writes what squeue, sacct,
scontrol and sinfo answer, with the backend's own flags, plus `jobs_<version>.json`: which
job id plays which part (failed, killed, requeued, ...), so the parser tests can ask the same
questions of every release. It takes about two minutes (a one-minute time limit, a node
failure). Not a test: the files it writes are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ftslurm.backends.slurm_cli import parse
from ftslurm.core.types import JobState
from ftslurm.localcluster import LocalCluster, wait_for
from ftslurm.localcluster.rootfs import VERSIONS

DATA = Path(__file__).parent / "data"
SLEEP = "#!/bin/bash\nsleep 600\n"


class Recorder:
    def __init__(self, cluster: LocalCluster, workdir: Path) -> None:
        self.cluster = cluster
        self.env = dict(cluster.env(), SLURM_TIME_FORMAT="%s")
        self.workdir = workdir

    def run(self, *argv: str, stdin: str | None = None, check: bool = True) -> str:
        proc = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.workdir,
            timeout=60,
        )
        if check and proc.returncode != 0:
            sys.exit(f"Error: {' '.join(argv[:3])} failed: {proc.stderr.strip()}")
        return proc.stdout

    def submit(self, script: str, *flags: str) -> str:
        return parse.parse_sbatch_job_id(self.run("sbatch", "--parsable", *flags, stdin=script))

    def state(self, job: str) -> JobState:
        out = self.run(
            "squeue", "-h", "--states=all", f"--jobs={job}", "-O", parse.SQUEUE_FORMAT, check=False
        )
        info = parse.parse_squeue(out, 0).get(job)
        return info.state if info else JobState.UNKNOWN

    def snapshot(self, ids: list[str]) -> tuple[str, str]:
        """What squeue and `scontrol show job` say of `ids` now."""
        squeue = self.run(
            "squeue", "-h", "--states=all", f"--jobs={','.join(ids)}", "-O", parse.SQUEUE_FORMAT
        )
        show = "".join(self.run("scontrol", "show", "job", "-o", j, check=False) for j in ids)
        return squeue, show

    def wait(self, job: str, cond, timeout: float, what: str) -> None:
        wait_for(lambda: cond(self.state(job)), timeout, f"job {job} {what}")


def record(version: str) -> None:
    cluster = LocalCluster(version=version)
    if not cluster.is_up():
        sys.exit(
            f"Error: the Slurm {version} cluster is not up "
            f"(python -m ftslurm.localcluster --version {version} up)"
        )
    cluster.wait_nodes_idle(timeout=60)
    rec = Recorder(cluster, Path(tempfile.mkdtemp(prefix="ftslurm-record-", dir="/tmp")))
    running = lambda s: s is JobState.RUNNING  # noqa: E731
    ended = lambda s: s.is_terminal  # noqa: E731
    jobs: dict[str, str] = {}
    jobs["cancelled"] = rec.submit(
        SLEEP, "--job-name=roundtrip", "--comment=ftslurm:run=r1:attempt=0"
    )
    rec.wait(jobs["cancelled"], running, 30, "running")
    rec.run("scancel", jobs["cancelled"])
    jobs["two_node"] = rec.submit("#!/bin/bash\nsrun true\n", "-N2")
    jobs["failed"] = rec.submit("#!/bin/bash\nexit 3\n")
    jobs["killed"] = rec.submit("#!/bin/bash\nkill -9 $$\n")
    for role in ("two_node", "failed", "killed"):
        rec.wait(jobs[role], ended, 60, "ended")
    jobs["requeued"] = rec.submit(SLEEP, "--job-name=requeue-fast")
    rec.wait(jobs["requeued"], running, 30, "running")
    rec.run("scontrol", "requeue", jobs["requeued"])
    rec.wait(jobs["requeued"], lambda s: s is JobState.PENDING, 30, "pending again")
    rec.run("scontrol", "update", f"jobid={jobs['requeued']}", "StartTime=now")
    rec.wait(jobs["requeued"], running, 30, "running again")
    rec.run("scancel", jobs["requeued"])
    rec.wait(jobs["requeued"], ended, 30, "cancelled")
    # The controller forgets an ended job after MinJobAge (60 s here): what squeue and
    # scontrol show of these is taken now, the rest at the end.
    early = list(jobs.values())
    snapshots = [rec.snapshot(early)]
    jobs["node_fail"] = rec.submit(SLEEP, "-N2", "--job-name=nodefail")
    rec.wait(jobs["node_fail"], running, 30, "running")
    out = rec.run("squeue", "-h", f"--jobs={jobs['node_fail']}", "-O", parse.SQUEUE_FORMAT)
    victim = parse.parse_squeue(out, 0)[jobs["node_fail"]].nodes[1]
    cluster.fail_node(victim)
    rec.wait(
        jobs["node_fail"],
        lambda s: s in (JobState.PENDING, JobState.NODE_FAIL),
        90,
        "requeued after the node failure",
    )
    rec.run("scancel", jobs["node_fail"])
    cluster.revive_node(victim)
    jobs["timeout"] = rec.submit("#!/bin/bash\nsleep 600\n", "-t", "1", "--job-name=walllimit")
    rec.wait(jobs["timeout"], ended, 150, "timed out")
    jobs["find_failed"] = rec.submit(
        "#!/bin/bash\nexit 3\n", "--job-name=odd|name", "--comment=ftslurm:rec1:0"
    )
    jobs["find_completed"] = rec.submit(
        "#!/bin/bash\ntrue\n", "--job-name=plain", "--comment=ftslurm:rec2:1"
    )
    for role in ("find_failed", "find_completed"):
        rec.wait(jobs[role], ended, 60, "ended")
    jobs["live"] = rec.submit(
        SLEEP, "-N2", "-t", "10", "--job-name=live run", "--comment=ftslurm:run=abc:attempt=1"
    )
    jobs["held"] = rec.submit(SLEEP, "--hold", "--job-name=held")
    rec.wait(jobs["live"], running, 30, "running")
    wait_for(
        lambda: "JobHeldUser" in rec.run("squeue", "-h", "-j", jobs["held"], "-o", "%r"),
        30,
        "the held job's reason",
    )
    plain = [j for r, j in jobs.items() if not r.startswith("find_")]
    ids = ",".join(plain)
    snapshots.append(rec.snapshot([j for j in plain if j not in early]))
    outputs = {
        "squeue": "".join(squeue for squeue, _ in snapshots),
        "sacct": rec.run(
            "sacct", "-X", "-D", "-P", "-n", f"--jobs={ids}", "-o", parse.SACCT_FORMAT
        ),
        "sacct_find": rec.run(
            "sacct",
            "-X",
            "-D",
            "-P",
            "-n",
            f"--delimiter={parse.SEP}",
            f"--jobs={jobs['find_failed']},{jobs['find_completed']}",
            "-o",
            parse.SACCT_FIND_FORMAT,
        ),
        "scontrol_show_job": "".join(show for _, show in snapshots),
        "scontrol_show_config": rec.run("scontrol", "show", "config"),
        "sinfo": rec.run("sinfo", "-h", "-N", "-o", "%N|%t|%E"),
    }
    for name, text in outputs.items():
        # The host-specific bits that do not matter to the parsers.
        text = text.replace(str(rec.workdir), "/home/alice/project")
        (DATA / f"{name}_{version}.txt").write_text(text)
    (DATA / f"jobs_{version}.json").write_text(json.dumps(jobs, indent=1) + "\n")
    for job in (jobs["live"], jobs["held"]):
        rec.run("scancel", job)
    print(f"recorded Slurm {version}: {', '.join(sorted(outputs))} into {DATA}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", required=True, choices=VERSIONS)
    record(parser.parse_args(argv).version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
