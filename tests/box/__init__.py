"""Tests that boot a tower in a box: systemd as PID 1 (tests/support/box.py)."""
