"""Helpers shared by the test folders (importable as ``support.<name>``; ``tests/`` is on the
path, see ``[tool.pytest.ini_options]``): ``mini`` (a small DSA-flavoured metadata family with
every kind of declaration), ``graphs`` (a graphed MTP-like step over it and the checks shared by
the emulated and CUDA tests), ``engine`` (running the reference engine, acceptance, draft-loop
traces), ``audit`` (planted audit bugs), ``distributed`` (multi-rank scenarios), ``cli_targets``
(capture targets for the CLI tests), ``ops`` (random buffer sets: mixed dtypes, odd and zero
sizes, storage offsets), ``errors`` (the error catalog behind ``docs/errors.md``)."""
