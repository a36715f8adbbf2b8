"""The commands of ``regkit``, one module each; :mod:`regkit_cli.main` registers them on the app."""
