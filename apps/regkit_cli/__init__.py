"""The ``regkit`` command-line interface (typer)."""
