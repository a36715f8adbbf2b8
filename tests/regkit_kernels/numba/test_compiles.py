"""The first-use notice: said before numba's first compile in a block, with the count and seconds at its end."""

import pytest

numba = pytest.importorskip("numba")

from regkit.process import announce_compiles  # noqa: E402
from regkit_kernels.numba.compiles import NOTICE  # noqa: E402


def test_compiles_are_announced_once_with_their_count():
    @numba.njit
    def add_one(x):
        return x + 1

    @numba.njit
    def twice(x):
        return 2 * add_one(x)  # compiled inside twice's own compile: one top-level compile

    lines: list[str] = []
    with announce_compiles(lines.append):
        assert twice(1) == 4
        assert twice(2) == 6  # already compiled
    assert lines[0] == NOTICE
    assert len(lines) == 2 and lines[1].startswith("compiled 1 CPU kernel in ")


def test_nothing_is_said_when_nothing_compiles():
    @numba.njit
    def square(x):
        return x * x

    square(3)
    lines: list[str] = []
    with announce_compiles(lines.append):
        assert square(4) == 16
    assert lines == []
