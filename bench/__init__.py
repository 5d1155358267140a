"""The benchmarks, a package: run one as `python -m bench.NAME` (or `python bench/NAME.py` from
the project's virtual environment, whose editable install puts the project root on the path).
Each prints its figures; with `--json` its last line is one object. bench/RESULTS.md holds the
latest figures of each, bench/HISTORY.md every run."""
