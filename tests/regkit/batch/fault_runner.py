"""A batch run that kills itself (SIGKILL) in one window of a job, for tests/regkit/batch/test_exactly_once.py.

:func:`run_batch_process` runs a batch in this process (a fresh one: the test starts it by multiprocessing's
forkserver, which imported this module, and with it regkit, once) with :func:`install`'s patches, which also the
dask workers get (:func:`dask_setup`, a dask preload). Every rename of a job's temporary folder into place, the
moment its output is complete, appends the job's folder name to ``LOG``, in whichever process it happens.

A kill is armed by token files in ``ARM`` (a folder): the first job not killed before (``ARM/killed``) that reaches
the window takes one token, atomically, and the process that holds it is killed there. The windows:

* ``writing``: while the job's files are written into its temporary folder (at ``affine.mat``);
* ``before-rename``: with the temporary folder complete, just before its rename into place;
* ``renamed``: just after that rename (local: before the manifest's update; dask: in the worker, before it returns);
* ``outcome``: in the batch process, with the job's outcome there, just before the manifest's update (dask);
* ``finished``: in the batch process, just after the manifest's update.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import Any

import regkit.batch.manifest
import regkit.results.folder
from regkit.batch import Manifest, load_spec, run_batch

WINDOWS = ("writing", "before-rename", "renamed", "outcome", "finished")
_ENV = "REGKIT_TEST_FAULT"  # WINDOW|ARM|LOG, for the dask workers


def _claim(arm: Path, name: str) -> bool:
    """Whether this process takes a kill token for job ``name`` (not killed before)."""
    killed = arm / "killed"
    if killed.is_file() and name in killed.read_text().split("\n"):
        return False
    for token in sorted(arm.glob("token-*")):
        try:
            os.rename(token, arm / f"fired-{token.name}")
        except FileNotFoundError:  # taken by another process
            continue
        with open(killed, "a") as handle:
            handle.write(name + "\n")
        return True
    return False


def _log(log: Path, name: str) -> None:
    with open(log, "a") as handle:
        handle.write(name + "\n")


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(window: str, arm: Path, log: Path) -> None:
    """Patch this process: log every job folder's rename into place, and kill it in ``window`` when a token is
    taken."""
    os.environ[_ENV] = f"{window}|{arm}|{log}"
    rename = os.rename

    def logged_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        src, dst = Path(src), Path(dst)
        into_place = src.name.startswith(f"{dst.name}.tmp-")
        if into_place and window == "before-rename" and _claim(arm, dst.name):
            _kill()
        rename(src, dst, *args, **kwargs)
        if into_place:
            _log(log, dst.name)
            if window == "renamed" and _claim(arm, dst.name):
                _kill()

    os.rename = logged_rename
    write_affine = regkit.results.folder.write_itk_affine

    @functools.wraps(write_affine)
    def killed_while_writing(path: Path, *args: Any, **kwargs: Any) -> Any:
        name = Path(path).parent.name.partition(".tmp-")[0]
        if window == "writing" and _claim(arm, name):
            _kill()
        return write_affine(path, *args, **kwargs)

    regkit.results.folder.write_itk_affine = killed_while_writing
    finish = Manifest.finish

    def killed_finish(self: Manifest, outcome: Any) -> None:
        if window == "outcome" and _claim(arm, outcome.name):
            _kill()
        finish(self, outcome)
        if window == "finished" and _claim(arm, outcome.name):
            _kill()

    regkit.batch.manifest.Manifest.finish = killed_finish  # type: ignore[method-assign]


def dask_setup(worker: Any) -> None:
    """dask's preload hook: the batch process's patches in a worker."""
    window, arm, log = os.environ[_ENV].split("|")
    install(window, Path(arm), Path(log))


def run_batch_process(spec: Path, executor: str, window: str, arm: Path, log: Path, env: dict[str, str]) -> None:
    """Run the batch of ``spec`` with ``executor`` (dask: 2 local workers, with this module as their preload) and
    the environment variables ``env``, patched by :func:`install`."""
    os.environ.clear()
    os.environ.update(env)
    install(window, arm, log)
    if executor == "dask":
        import dask

        dask.config.set({"distributed.worker.preload": [__file__]})
    run_batch(load_spec(spec), executor=executor, workers=2)
