"""``python -m regkit`` runs the command-line interface (installed with the package as ``regkit_cli``)."""

from regkit_cli.main import main

if __name__ == "__main__":
    main()
