"""regkit's benchmarks, run from a checkout's root: ``python -m benchmarks COMMAND ...`` (``--help`` lists them).

Not part of the installed package: the ``regkit`` command never imports them. One command per module (``cpab``,
``wtconv``, ``registration``, ``features``, ``accuracy``, ``batch``); ``scripts/`` holds standalone measurement
scripts, ``results/`` the logs of past runs.

Commands that measure in fresh processes start them as ``python -c "from benchmarks.MODULE import worker; worker()"``,
which finds this package in the working folder (or on ``PYTHONPATH``): hence run from the checkout's root.
"""
