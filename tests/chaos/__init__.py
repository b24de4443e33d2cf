"""The chaos soak: the whole product under seeded faults (tests/chaos/harness.py)."""
