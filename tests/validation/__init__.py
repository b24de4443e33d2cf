"""Home Assistant's own checks of the integration's files (run after the tower tests: see test_hassfest)."""
