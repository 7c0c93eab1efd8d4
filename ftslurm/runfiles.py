"""Reading and writing the reports a run's directory holds (`ftslurm.core.contract.reports`).

`read_reports` is the one place that lists a kind of report (and `rank_reports` one rank's
reports across the attempts): a torn, damaged or foreign file is left out (read again when
it changes), never fatal, so a daemon reading a file a launcher is still writing, or one an
older or newer ftslurm wrote, goes on. `read_report` reads one file the same way.
`write_report` writes a model atomically, with the keys its writer gave.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftslurm.core.contract import RANK_REPORTS, RunDir, observed_record
from ftslurm.core.contract.reports import Kind, M, RankReport, Report, parse
from ftslurm.fsutil import read_json, write_json_atomic


def read_report(path: Path | str, model: type[M]) -> M | None:
    """The report at `path`, or None (missing, torn, or not a `model`)."""
    return parse(model, read_json(path))


def report_folder(run: RunDir, kind: Kind, attempt: int | str | None = None) -> Path:
    """The folder of `run` that holds the reports of `kind` (of `attempt`)."""
    if kind.folder == "stragglers":
        return run.stragglers
    if attempt is None:
        raise ValueError(f"{kind.name} reports belong to an attempt")
    return run.recovery(attempt) if kind.folder == "recovery" else run.attempt(attempt)


def read_reports(
    run: RunDir | Path | str, kind: Kind, attempt: int | str | None = None
) -> list[Any]:
    """Every readable report of `kind` (of `attempt`) in `run`'s directory, in the order
    of their file names; a torn, damaged or invalid one is left out."""
    rd = run if isinstance(run, RunDir) else RunDir(run)
    folder = report_folder(rd, kind, attempt)
    found = (read_report(p, kind.model) for p in sorted(folder.glob(kind.pattern)))
    return [r for r in found if r is not None]


def rank_reports(run: RunDir | Path | str, rank: int) -> list[RankReport]:
    """Rank `rank`'s report of every attempt of `run` that has one (in the order of the
    attempts' folder names); a torn, damaged or invalid one is left out."""
    rd = run if isinstance(run, RunDir) else RunDir(run)
    name = rd.rank_report(0, rank).name
    found = (read_report(p, RankReport) for p in sorted(rd.attempts.glob(f"*/{name}")))
    return [r for r in found if r is not None]


def write_report(path: Path | str, report: Report, mode: int = 0o644) -> None:
    """Write `report` at `path` atomically (its folder made first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, report.to_json(), mode=mode)


def read_observed(checkpoint_dir: Path | str) -> list[dict[str, Any]]:
    """What the ranks of earlier attempts observed of their sections (`observed_record`,
    one file per rank in the checkpoint directory): a torn or foreign file left out."""
    folder = observed_record(checkpoint_dir, 0).parent
    found = (read_json(p) for p in sorted(folder.glob(RANK_REPORTS)))
    return [r for r in found if isinstance(r, dict)]
