#!/usr/bin/env bash
# Runs inside the provisioned environment (see scripts/test).
set -euo pipefail
step() { printf '\n== %s\n' "$*"; }

step "ruff check"
ruff check .
step "ruff format --check"
ruff format --check .
step "mypy --strict"
mypy
step "pytest"
# pytest exits 5 when it collected no test: that is a failure here too.
pytest --cov=custom_components.gpu_handoff --cov-report=term-missing \
  --cov-fail-under=95 "$@"
step "config flow coverage"
coverage report --include='custom_components/gpu_handoff/config_flow*.py' --fail-under=100
