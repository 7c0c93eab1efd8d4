"""`ftslurm submit` with bad input: one line `Error: ...`, nothing recorded, nothing submitted.
And the sbatch flags it takes reach the batch script, each exactly once."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from ftslurm.backends.mock import model
from ftslurm.backends.mock.model import MockConfig, MockState
from ftslurm.cli.common import console
from ftslurm.cli.main import main
from ftslurm.daemon.records import NodeFlag
from ftslurm.daemon.store import Store
from ftslurm.daemon.submission import build_attempt, make_spec
from ftslurm.recipe import load_recipe

TRAIN = "#!/bin/bash\n#SBATCH -N 1\necho training\n"


@pytest.fixture()
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("FTSLURM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FTSLURM_MOCK_HOME", str(tmp_path / "mock"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.sh").write_text(TRAIN)
    (tmp_path / "header.sh").write_text(
        "#!/bin/bash\n#SBATCH -q normal -C 'a&b'\n#SBATCH --mem=4G # per node\necho hi\n"
    )
    (tmp_path / "binary.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\xff\xfe")
    (tmp_path / "folder").mkdir()
    (tmp_path / "noshebang.sh").write_text("echo training\n")
    with (tmp_path / "huge.py").open("wb") as f:  # sparse: no disk, no time to write
        f.truncate(17 * 1024 * 1024)
    for name, header in [
        ("owned_out", "--output=x.log"),
        ("owned_array", "-a 0-3"),
        ("unclosed", "--qos='high"),
        ("bare", "normal"),
    ]:
        (tmp_path / f"{name}.sh").write_text(f"#!/bin/bash\n#SBATCH {header}\necho hi\n")
    for name, body in [
        ("badkey", "env={'BAD-KEY': 'x'}"),
        ("nulenv", "env={'A': 'x\\0y'}"),
        ("comment", "sbatch_extra={'comment': 'mine'}"),
        ("newname", "name='a\\nrm -rf ~'"),
    ]:
        (tmp_path / f"{name}.py").write_text(
            f"import ftslurm\nrecipe = ftslurm.Recipe(command=['true'], {body})\n"
        )
    return tmp_path


def submit(env: Path, capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["submit", *argv])
    out, err = capsys.readouterr()
    return code, out, err


T = ["-t", "10", "--dry-run"]  # a time limit: no warning line next to the error
BAD = [
    # issue 26 item 4: a node the mock cluster does not have (it once killed the mock)
    (["--inject", "node_fail@3:n99", "train.sh"], "node_fail@3:n99: the mock cluster in"),
    (["--inject", "straggler@3:gpu7*2", "train.sh"], "has no such node"),
    (["--name", "a\necho pwned", "train.sh"], "--job-name"),
    (["-J", "a\rb", "train.sh"], "--job-name"),
    (["--name", "", "train.sh"], "name"),
    (["-p", "gpu\n#SBATCH --qos=top", "train.sh"], "--partition"),
    (["-A", "acct\x1b[2J", "train.sh"], "--account"),
    (["--exclude", "n1\nn2", "train.sh"], "--exclude"),
    (["--checkpoint-dir", "ck\npt", "train.sh"], "--checkpoint-dir"),
    (["--mem", "4G\n", "train.sh"], "--mem"),
    (["-q", "a\tb", "train.sh"], "--qos"),
    (["-C", "a\u2028b", "train.sh"], "line separator"),
    (["--mail-user", "me\x00@x", "train.sh"], "--mail-user"),
    (["--sbatch-arg", "--begin=now\necho x", "train.sh"], "--begin"),
    (["--sbatch-arg", "--output=x.log", "train.sh"], "ftslurm writes each attempt's output"),
    (["--sbatch-arg", "--signal=USR1@60", "train.sh"], "--signal is set by ftslurm"),
    (["--sbatch-arg", "-a0-3", "train.sh"], "each array task would be a separate run"),
    (["--sbatch-arg", "--requeue", "train.sh"], "requeues the job itself"),
    (["--sbatch-arg", "--comment=x", "train.sh"], "tags each job"),
    (["--sbatch-arg", "high", "train.sh"], "is not an sbatch option"),
    (["--sbatch-arg", "--bad flag=1", "train.sh"], "is not a flag name"),
    (["-o", "out.log", "train.sh"], "ftslurm writes each attempt's output"),
    (["-e", "err.log", "train.sh"], "ftslurm writes each attempt's output"),
    (["--array", "0-3", "train.sh"], "each array task would be a separate run"),
    (["owned_out.sh"], "owned_out.sh #SBATCH lines: --output is set by ftslurm"),
    (["owned_array.sh"], "--array is set by ftslurm itself"),
    (["unclosed.sh"], "unmatched '"),
    (["bare.sh"], "'normal' is not an sbatch option"),
    (["binary.bin"], "is not a text file"),
    (["missing.sh"], "recipe not found"),
    (["folder"], "is a directory"),
    (["--gpus-per-node", "-1", "train.sh"], "gpus_per_node"),
    (["-N", "0", "train.sh"], "nodes"),
    (["-n", "3", "-N", "2", "train.sh"], "same number of ranks on every node"),
    (["-n", "4", "-N", "2", "--ntasks-per-node", "1", "train.sh"], "is not --nodes 2 times"),
    (["--inject", "explode@3", "train.sh"], "unknown injection kind"),
    (["--inject", "crash@soon", "train.sh"], "malformed duration"),
    (["--preempt-time", "5x", "train.sh"], "--preempt-time: malformed duration '5x'"),
    (["--preempt-time", "-5", "train.sh"], "--preempt-time"),
    (["--preempt-time", "10m", "train.sh"], "not shorter than the time limit"),
    (["--preempt-time", "600", "train.sh"], "not shorter than the time limit"),
    (["badkey.py"], "'BAD-KEY' is not a shell name"),
    (["nulenv.py"], "NUL byte"),
    (["comment.py"], "--comment is set by ftslurm itself"),
    (["newname.py"], "--job-name"),
    (["train.sh", "--", "a\x00b"], "NUL byte"),
    # issue 26 item 6: a recipe that is no script is refused at submit, not run into exit 126
    (["noshebang.sh"], "not a Python file (.py) and not a script (no #! line)"),
    (["../" * 30 + "etc/passwd"], "not a script (no #! line)"),
    (["huge.py"], "is 17.0 MiB: a recipe file is at most 16 MiB"),
]
BAD_TIMES = [
    (["-t", "1:99:99x", "--dry-run", "train.sh"], "malformed time limit '1:99:99x'"),
    (["-t", "-5", "--dry-run", "train.sh"], "malformed time limit '-5'"),
    (["-t", "ten", "--dry-run", "train.sh"], "malformed time limit"),
    (["-t", "1\n", "--dry-run", "train.sh"], "--time"),
    (["-t", "1", "--dry-run", "train.sh"], "not shorter than the time limit"),  # 60 s lead
    # issue 26 item 6: limits Slurm cannot hold, fields out of range, non-ASCII digits
    (["-t", "9" * 30, "--dry-run", "train.sh"], "is longer than Slurm takes"),
    (["-t", "35791395", "--dry-run", "train.sh"], "is longer than Slurm takes"),
    (["-t", "24855-03:14:08", "--dry-run", "train.sh"], "at most 24855 days"),
    (["-t", "1-99", "--dry-run", "train.sh"], "99 hours is out of range (0-23 after days)"),
    (["-t", "1:75:00", "--dry-run", "train.sh"], "75 minutes is out of range"),
    (["-t", "5:60", "--dry-run", "train.sh"], "60 seconds is out of range"),
    (["-t", "\u0661\u0662", "--dry-run", "train.sh"], "malformed time limit"),
]


@pytest.mark.parametrize(
    "argv,fragment",
    [(T + a, f) for a, f in BAD] + BAD_TIMES,
    ids=lambda v: repr(v)[:60] if isinstance(v, list) else None,
)
def test_bad_input_is_one_line_and_records_and_submits_nothing(env, capsys, argv, fragment):
    code, out, err = submit(env, capsys, *argv)
    assert code != 0
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert fragment in lines[0]
    assert "Traceback" not in err and out == ""
    # Nothing recorded (no state folder at all) and nothing reached the mock scheduler.
    assert not (env / "home").exists() and not (env / "mock").exists()


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH ")]


NEW_FLAGS = [
    (["-J", "myrun"], "--job-name=myrun"),
    (["--name", "other"], "--job-name=other"),
    (["-c", "2"], "--cpus-per-task=2"),
    (["--mem", "64G"], "--mem=64G"),
    (["--mem-per-cpu", "4G"], "--mem-per-cpu=4G"),
    (["--gres", "gpu:8"], "--gres=gpu:8"),
    (["-G", "16"], "--gpus=16"),
    (["-C", "a100"], "--constraint=a100"),
    (["-q", "high"], "--qos=high"),
    (["--dependency", "afterok:12"], "--dependency=afterok:12"),
    (["--mail-type", "END,FAIL"], "--mail-type=END,FAIL"),
    (["--mail-user", "me@x.org"], "--mail-user=me@x.org"),
    (["-w", "n1,n2"], "--nodelist=n1,n2"),
    (["-x", "n3"], "--exclude=n3"),
    (["--exclusive"], "--exclusive"),
    (["-n", "1"], "--ntasks=1"),
    (["--reservation", "r1"], "--reservation=r1"),
    (["--wckey", "wk"], "--wckey=wk"),
    (["--sbatch-arg=--begin=now+1hour"], "--begin=now+1hour"),
    (["--sbatch-arg", "-k"], "--no-kill"),
    (["--sbatch-arg=-q", "--sbatch-arg=low"], "--qos=low"),
    (["-J", "a b'c"], "'--job-name=a b\\'c'"),
]


@pytest.mark.parametrize(
    "argv,line", NEW_FLAGS, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_each_sbatch_flag_reaches_the_script_exactly_once(env, capsys, argv, line):
    # header.sh sets -q, -C and --mem itself: the command line replaces them, never doubles.
    code, out, err = submit(env, capsys, "--print-script", "-t", "30", *argv, "header.sh")
    assert code == 0, err
    lines = sbatch_lines(out)
    assert lines.count(f"#SBATCH {line}") == 1, lines
    flag = re.match(r"'?(--[a-z-]+)", line)[1]
    assert [re.match(r"#SBATCH '?(--[a-z-]+)", x)[1] for x in lines].count(flag) == 1
    assert err == ""
    assert not (env / "home").exists()


def test_short_sbatch_forms_in_a_script_header_are_read(env, capsys):
    code, out, err = submit(env, capsys, "--print-script", "-t", "30", "header.sh")
    assert code == 0, err
    lines = sbatch_lines(out)
    for line in ("--qos=normal", "'--constraint=a&b'", "--mem=4G"):
        assert lines.count(f"#SBATCH {line}") == 1, lines


@pytest.mark.parametrize("limit", ["UNLIMITED", "infinite", "0", "0:00:00"])
def test_no_time_limit_works_and_warns_once(env, capsys, limit):
    code, out, err = submit(env, capsys, "--print-script", "-t", limit, "train.sh")
    assert code == 0, err
    assert "#SBATCH --time=UNLIMITED" in sbatch_lines(out)
    assert not any("--signal" in x for x in sbatch_lines(out))  # nothing to signal before
    assert err.count("\n") == 1 and err.startswith("Warning: ") and "checkpoint" in err


def test_no_time_limit_given_warns_once(env, capsys):
    code, out, err = submit(env, capsys, "--print-script", "train.sh")
    assert code == 0 and not any("--time" in x for x in sbatch_lines(out))
    assert err.startswith("Warning: no -t") and err.count("\n") == 1
    _, _, quiet = submit(env, capsys, "--print-script", "--preempt-time", "0", "train.sh")
    assert quiet == ""  # no checkpoint signal asked for: nothing to warn about


@pytest.mark.parametrize(
    "preempt,signal",
    [("90s", "USR2@90"), ("5m", "USR2@300"), ("120", "USR2@120"), ("1.5m", "USR2@90")],
)
def test_preempt_time_takes_the_duration_forms_of_inject(env, capsys, preempt, signal):
    code, out, err = submit(
        env, capsys, "--print-script", "-t", "60", "--preempt-time", preempt, "train.sh"
    )
    assert code == 0, err
    assert f"#SBATCH --signal={signal}" in sbatch_lines(out)


@pytest.mark.parametrize(
    "argv,ranks",
    [
        (["--gpus-per-node", "8"], 8),
        (["--gpus-per-node", "8", "--ntasks-per-node", "2"], 2),
        (["-N", "2", "-n", "8"], 4),
        ([], 1),
        (["--gpus-per-node", "0"], 1),
    ],
)
def test_ranks_per_node(env, capsys, argv, ranks):
    code, out, err = submit(env, capsys, "--print-script", "-t", "30", *argv, "train.sh")
    assert code == 0, err
    assert f"--nproc-per-node={ranks} " in out
    assert f"#SBATCH --ntasks-per-node={ranks}" in sbatch_lines(out)


def test_the_mock_takes_sbatch_flags_it_does_not_model(env, tmp_path):
    recipe = load_recipe(env / "train.sh").with_overrides(
        time="10",
        sbatch_extra={
            "mem": "4G",
            "gres": "gpu:1",
            "qos": "high",
            "exclusive": None,
            "constraint": "a&b",
            "mail-type": "END",
            "wckey": "w",
        },
    )
    spec = make_spec(recipe, run_dir=tmp_path / "run", backend="mock", workdir=str(tmp_path))
    script, options = build_attempt("r1", spec, {}, 0, ())
    st = MockState.create(MockConfig())
    job_id = model.submit(st, script, options, 0.0)
    assert st.jobs[job_id].time_limit_s == 600 and st.jobs[job_id].open_mode == "append"


@pytest.mark.parametrize(
    "limit,seconds",
    [
        ("24855-03:14:07", 2**31 - 1),
        ("1-23:59:59", 172799),
        ("35791394", 35791394 * 60),
        ("0:59", 59),
    ],
)
def test_the_longest_limits_slurm_takes_are_taken(limit, seconds):
    from ftslurm.core.timefmt import parse_time_limit

    assert parse_time_limit(limit) == seconds


USAGE = [
    (["submit", "-N", "abc", "train.sh"], "'--nodes'", None),
    (["submit", "--bogus", "train.sh"], "No such option: --bogus", None),
    (["submit", "train.sh", "--lr", "3e-4"], "No such option: --lr", "after `--`"),
    (["watch", "--interval", "0"], "'--interval'", None),
    (["status", "--bogus"], "No such option: --bogus", None),
    (["submit"], "Missing argument 'RECIPE'", None),
    (["nosuch"], "No such command 'nosuch'", None),
]


@pytest.mark.parametrize(
    "argv,fragment,hint", USAGE, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_a_usage_error_is_one_error_line(env, capsys, argv, fragment, hint):
    """Issue 26 item 6: bad usage is one `Error:` line naming the command's --help (plus
    the one hint of a common mistake), never typer's box of usage lines."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("Error: ") and fragment in lines[0], err
    assert f"(see `ftslurm {argv[0] if argv[0] != 'nosuch' else ''}".rstrip() in lines[0]
    assert lines[1:] == ([f"Hint: {lines[1][6:]}"] if hint else []), err
    assert not hint or hint in lines[1]
    assert "Usage:" not in err and "\u256d" not in err  # no usage line, no box


def test_a_node_reason_with_control_characters_is_refused(env, capsys):
    """Issue 26 item 6: `nodes add --reason` with ESC and a newline is refused in one line
    (nothing recorded), never stored and printed raw by `nodes list`."""
    code = main(["nodes", "add", "n1", "--reason", "bad\x1b[2J\nsecond line"])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("Error: --reason ") and "control" in err
    assert not (env / "home").exists()


def test_nodes_list_escapes_a_reason_stored_before_control_characters_were_refused(
    env, capsys, monkeypatch
):
    """A reason stored before `nodes add` refused control characters (written into the
    store directly here) is shown escaped, never as a raw terminal sequence."""
    monkeypatch.setattr(console, "_width", 200)  # the reason on one line of the table
    with Store(env / "home") as store:
        store.flag_node(NodeFlag("n1", "bad\x1b[2J\nsecond line\x07", time.time(), None))
    code = main(["nodes", "list"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not any(c in out for c in "\x1b\x07"), repr(out)
    assert "bad\\x1b[2J\\nsecond line\\x07" in out, out
    code = main(["nodes", "list", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and "\x1b" not in out
    assert json.loads(out)[0]["reason"] == "bad\x1b[2J\nsecond line\x07"
