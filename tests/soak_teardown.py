"""Soak under load: the two tests that used to abort now and then in gloo's teardown, many
times in a row, with every core kept busy by a stress process.

    python tests/soak_teardown.py            # 20 runs of each
    python tests/soak_teardown.py --runs 50

Each run is its own pytest process (a fresh interpreter, as in CI). Prints one line per
failure and the figure at the end (passes/runs per test); exits non-zero unless every run
passed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = (
    "tests/test_launch.py::test_sigterm_makes_every_rank_checkpoint_at_the_same_step_and_ask_to_continue",
    "tests/test_checkpoint.py::test_sharded_round_trip_two_ranks",
)
BUSY = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each test (default 20)")
    parser.add_argument(
        "--stress",
        type=int,
        default=os.cpu_count() or 2,
        help="busy processes (default: one per core)",
    )
    args = parser.parse_args(argv)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    stress = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.stress)]
    passed = {test: 0 for test in TESTS}
    started = time.monotonic()
    try:
        for i in range(args.runs):
            for test in TESTS:
                done = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if done.returncode == 0:
                    passed[test] += 1
                else:
                    tail = "\n".join(done.stdout.splitlines()[-15:])
                    print(f"run {i + 1}: FAILED {test}\n{tail}", flush=True)
            print(
                f"run {i + 1}/{args.runs}: "
                + ", ".join(f"{t.split('::')[1][:40]} {n}/{i + 1}" for t, n in passed.items()),
                flush=True,
            )
    finally:
        for proc in stress:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    minutes = (time.monotonic() - started) / 60
    for test, n in passed.items():
        print(f"{n}/{args.runs} passed: {test}")
    print(f"{args.stress} stress process(es); {minutes:.1f} min")
    return 0 if all(n == args.runs for n in passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
