"""The regkit package itself: what ``import regkit`` loads and offers."""


def test_top_level_names_are_lazy():
    """``import regkit`` stays light; the main entry points resolve on first use."""
    import subprocess
    import sys

    code = (
        "import sys, regkit; assert 'regkit.registration' not in sys.modules; "
        "assert callable(regkit.register) and callable(regkit.load_config) and callable(regkit.read_image)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
