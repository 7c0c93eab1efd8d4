"""`make test` splits the tests without a cluster in four pytests by conftest's LANE2, LANE3
and LAST (markers `lane2`, `lane3`, `last`): each name listed there must name a test
function, or its pytest would silently lose it back to the foreground, and none is listed
twice; and the Makefile's four selections must cover exactly the tests without a cluster,
once each."""

import ast
from pathlib import Path

from .conftest import LANE2, LANE3, LAST

TESTS = Path(__file__).resolve().parent


def test_every_test_moved_to_the_second_lane_exists():
    missing = []
    for file, names in [*LANE2.items(), *LANE3.items(), *LAST.items()]:
        tree = ast.parse((TESTS / file).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        missing += [f"{file}::{name}" for name in names if name not in defined]
    assert not missing, missing
    lanes = [LANE2, LANE3, LAST]
    twice = {
        (f, i, j): set(a.get(f, ())) & set(b.get(f, ()))
        for i, a in enumerate(lanes)
        for j, b in enumerate(lanes)
        if i < j
        for f in {*a, *b}
    }
    assert not any(twice.values()), twice


def test_make_test_runs_each_test_without_a_cluster_in_exactly_one_lane():
    makefile = (TESTS.parent / "Makefile").read_text()
    assert '-m "not slurm and not lane2 and not lane3 and not last"' in makefile
    assert '-m "not slurm and lane2"' in makefile
    assert '-m "not slurm and lane3"' in makefile
    assert '-m "not slurm and last"' in makefile
