"""``regkit bench ...``: benchmarks, one command per module (imports of torch and regkit happen inside the commands)."""

from __future__ import annotations

import typer

from regkit_cli.bench.accuracy import accuracy
from regkit_cli.bench.batch import batch
from regkit_cli.bench.cpab import cpab
from regkit_cli.bench.features import features
from regkit_cli.bench.registration import registration
from regkit_cli.bench.wtconv import wtconv

app = typer.Typer(
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
