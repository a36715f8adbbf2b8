"""``python -m benchmarks ...``: the benchmarks, one command per module (torch and regkit are imported inside the
commands, so ``--help`` starts without them)."""

from __future__ import annotations

import typer

from benchmarks.accuracy import accuracy
from benchmarks.batch import batch
from benchmarks.common import CommandGroup
from benchmarks.cpab import cpab
from benchmarks.diffeomorphism import diffeomorphism
from benchmarks.features import features
from benchmarks.registration import registration
from benchmarks.wtconv import wtconv

app = typer.Typer(
    cls=CommandGroup,
    help="Benchmarks: time and peak memory of regkit's fast paths beside their baselines.",
    no_args_is_help=True,
    add_completion=False,
)

app.command("cpab")(cpab)
app.command("wtconv")(wtconv)
app.command("registration")(registration)
app.command("features")(features)
app.command("accuracy")(accuracy)
app.command("batch")(batch)
app.command("diffeomorphism")(diffeomorphism)

if __name__ == "__main__":
    app()
