"""Benchmarks: ``python -m hpcsplit.bench <name>``.

Each benchmark is a module ``hpcsplit/bench/<name>.py`` with a ``main(argv: list[str]) -> int``.
They print figures and ratios side by side; they never assert timings.
"""
