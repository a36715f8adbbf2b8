"""Running the ``regkit`` command line in-process, as the console script does."""

from __future__ import annotations

from regkit_cli.main import main


def run_cli(argv: list) -> int:
    """Run ``regkit ARGV`` through :func:`regkit_cli.main.main` and return its exit code (paths are stringified)."""
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0
