"""The benchmark: Home Assistant with the integration against the real agent.

Run it with ``scripts/bench`` (its files are named ``bench_*.py``, so the
normal test run does not collect them).
"""
