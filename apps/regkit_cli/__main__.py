"""``python -m regkit_cli`` runs the ``regkit`` command line, as the console script does."""

from regkit_cli.main import main

if __name__ == "__main__":
    main()
