"""Named mutants: hand-made breakages of what users depend on, each of which
the test suite must notice (tests/mutants/catalog.py, run by scripts/mutants).
"""
