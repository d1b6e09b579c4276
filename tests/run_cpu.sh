#!/usr/bin/env bash
# The test command of the README and of CI (.ci/run), for a fresh CPU machine with Python 3.11:
# installs the pinned environment, lints, runs the CPU suite against the pinned megatron-core
# (constraints.txt), then the integration tests against each older supported release, each in its
# own virtual environment under .venvs/ (made on first use; it reuses the pinned torch and pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -c constraints.txt -e ".[test]"
ruff check .
ruff format --check .
python -m pytest tests/cpu -q
# GPU hosts run megatron-core 0.19.2 (tests/gpu); 0.17 and 0.18 do not install on Python 3.11.
for release in 0.13.1 0.14.0 0.15.3; do
  env=".venvs/megatron-core-$release"
  [ -x "$env/bin/python" ] || python -m venv --system-site-packages "$env"
  "$env/bin/python" -m pip install -q -c constraints-older-megatron.txt "megatron-core==$release" numpy
  echo "integration tests on megatron-core $release"
  "$env/bin/python" -m pytest tests/cpu/test_integration_*.py -q
done
