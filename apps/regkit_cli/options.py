"""Options that several commands share."""

from __future__ import annotations

from typing import Annotated

import typer

Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Replace an existing output file (never one of the command's inputs).")
]
"""``--overwrite`` of the commands that write one file (``-o FILE``)."""
