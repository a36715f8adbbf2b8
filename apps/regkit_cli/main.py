"""The ``regkit`` command line. Heavy imports (torch, SimpleITK, ...) happen inside the commands so --help is instant.

Every command runs through :func:`main`, which turns a :class:`regkit.errors.RegkitError` (and a few OS errors) into one
line on stderr and exit code 1; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from regkit_cli.bench import app as bench_app

app = typer.Typer(
    name="regkit",
    help="Fast, fold-free registration of 2D images and 3D medical volumes with CPAB transformations.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False}


def _version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"regkit {version('regkit')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback on errors.")] = False,
) -> None:
    _state["debug"] = debug


@app.command()
def info(
    image: Annotated[
        Path, typer.Argument(help="Image file (.nii, .nii.gz, .mha, .mhd, .nrrd, .nhdr, .png) or DICOM folder.")
    ],
):
    """Print an image's size, spacing, origin, direction, orientation code, dtype and value range."""
    from regkit.io import describe_image, read_image

    img = read_image(image, check_finite=False)
    for key, value in describe_image(img).items():
        typer.echo(f"{key:<12} {value}")


@app.command("check-config")
def check_config(
    config: Annotated[str, typer.Argument(help="A YAML file or the name of a preset (e.g. brain-mri-3d).")],
    show: Annotated[bool, typer.Option("--show", help="Print the resolved configuration as YAML.")] = False,
):
    """Validate a registration configuration (file or preset); print the resolved configuration with --show."""
    from regkit.config import dump_config, load_config

    cfg = load_config(config)
    if show:
        typer.echo(dump_config(cfg), nl=False)
    else:
        typer.echo(f"{config}: valid")


app.add_typer(bench_app, name="bench")


def _error_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script: run the typer app, printing user errors on one line (exit code 1)."""
    from regkit.errors import RegkitError

    try:
        app(args=argv, standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("Aborted.", err=True)
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors (typer >= 0.29 bundles click; its exceptions subclass this)
        exc.show()  # type: ignore[attr-defined]
        sys.exit(exc.exit_code)  # type: ignore[attr-defined]
    except Exception as exc:  # RegkitError, OS errors
        if _state["debug"] or not isinstance(exc, RegkitError | OSError | MemoryError):
            raise
        typer.echo(f"error: {_error_line(exc)}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
