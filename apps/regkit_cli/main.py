"""The ``regkit`` command line: the typer app, its root options and :func:`main`, the console script's entry point.

The commands live in :mod:`regkit_cli.commands`, one module each; heavy imports (torch, SimpleITK, ...) happen inside
them so --help is instant. Every command runs through :func:`main`, which turns a :class:`regkit.errors.RegkitError`
(and OS and memory errors) into one line on stderr and exit code 1, any other exception into one line with its type
and a pointer to ``--debug`` (exit code 1), and Ctrl-C into one line and exit code 130; ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from regkit.process import configure_process
from regkit_cli.commands.apply import apply
from regkit_cli.commands.batch import batch
from regkit_cli.commands.check_config import check_config
from regkit_cli.commands.demo import demo
from regkit_cli.commands.export import export
from regkit_cli.commands.info import info
from regkit_cli.commands.invert import invert
from regkit_cli.commands.jacobian import jacobian
from regkit_cli.commands.register import register
from regkit_cli.commands.train_features import train_features

configure_process()  # before torch is imported, which the commands do lazily

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


# In the order that `regkit --help` lists them: inspection, registration and its outputs, then the larger workflows.
app.command("info")(info)
app.command("check-config")(check_config)
app.command("register")(register)
app.command("apply")(apply)
app.command("invert")(invert)
app.command("jacobian")(jacobian)
app.command("export")(export)
app.command("demo")(demo)
app.command("batch")(batch)
app.command("train-features")(train_features)


INTERRUPTED = "interrupted (Ctrl-C); outputs appear only when complete, so nothing partly written was left"
"""The line a command stopped by Ctrl-C prints (exit code 130)."""
UNEXPECTED = "an error regkit did not foresee: rerun with --debug for the traceback, and please report it"
"""What follows the one line of an exception that is not a user error."""


def _error_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script: run the typer app, printing user errors on one line (exit code 1)."""
    from regkit.errors import RegkitError

    try:
        code = app(args=argv, standalone_mode=False)  # a typer.Exit raised in a command comes back as its code
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):  # Ctrl-C outside typer's own handling
        code = 130
    except typer.TyperException as exc:  # usage errors (typer >= 0.29 bundles click; its exceptions subclass this)
        exc.show()  # type: ignore[attr-defined]
        sys.exit(exc.exit_code)
    except Exception as exc:
        if _state["debug"]:
            raise
        if isinstance(exc, RegkitError | OSError | MemoryError):  # the user's input or machine: the message says
            typer.echo(f"error: {_error_line(exc)}", err=True)
        else:  # a failure regkit did not foresee: still one line, and how to see more
            typer.echo(f"error: {type(exc).__name__}: {_error_line(exc)} ({UNEXPECTED})", err=True)
        sys.exit(1)
    if code == 130:  # Ctrl-C: typer returns its exit code
        typer.echo(INTERRUPTED, err=True)
    if isinstance(code, int) and code != 0:
        sys.exit(code)
