"""``regkit check-config CONFIG``: validate a registration configuration, a YAML file or a preset."""

from __future__ import annotations

from typing import Annotated

import typer


def check_config(
    config: Annotated[str, typer.Argument(help="A YAML file or the name of a preset (e.g. brain-mri-3d).")],
    show: Annotated[bool, typer.Option("--show", help="Print the resolved configuration as YAML.")] = False,
) -> None:
    """Validate a registration configuration (file or preset); print the resolved configuration with --show."""
    from regkit.config import dump_config, load_config

    cfg = load_config(config)
    if show:
        typer.echo(dump_config(cfg), nl=False)
    else:
        typer.echo(f"{config}: valid")
