"""`make test` splits the tests without a cluster in three pytests by conftest's LANE2 and
LAST (markers `lane2`, `last`): each name listed there must name a test function, or its
pytest would silently lose it back to the foreground, and none is listed twice; and the
Makefile's three selections must cover exactly the tests without a cluster, once each."""

import ast
from pathlib import Path

from .conftest import LANE2, LAST

TESTS = Path(__file__).resolve().parent


def test_every_test_moved_to_the_second_lane_exists():
    missing = []
    for file, names in [*LANE2.items(), *LAST.items()]:
        tree = ast.parse((TESTS / file).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        missing += [f"{file}::{name}" for name in names if name not in defined]
    assert not missing, missing
    twice = {f: set(n) & set(LAST.get(f, ())) for f, n in LANE2.items()}
    assert not any(twice.values()), twice


def test_make_test_runs_each_test_without_a_cluster_in_exactly_one_lane():
    makefile = (TESTS.parent / "Makefile").read_text()
    assert '-m "not slurm and not lane2 and not last"' in makefile
    assert '-m "not slurm and lane2"' in makefile
    assert '-m "not slurm and last"' in makefile
