#!/usr/bin/env bash
# The test command of the README and of CI (.ci/run), for a fresh CPU machine with Python 3.11 and
# 3.12: installs the pinned environment, lints, runs the CPU suite against the pinned megatron-core
# (constraints.txt), then the integration tests against each other supported release, each in its
# own virtual environment under .venvs/ (made on first use): 0.13 to 0.15 on Python 3.11, reusing
# the pinned torch and pytest; 0.17 to 0.19, which need Python >= 3.12, on Python 3.12, sharing one
# torch environment (constraints-python3.12.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
# Found before the long suite runs, so that a machine without it fails at once. pyenv's python3.12
# shim is on PATH even where it only fails, hence each candidate is run.
python312=""
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    python312=$candidate
    break
  fi
done
if [ -z "$python312" ]; then
  echo "tests/run_cpu.sh: megatron-core 0.17 to 0.19 are tested on Python 3.12, which is neither python3.12" \
    "on PATH nor under ${PYENV_ROOT:-$HOME/.pyenv}/versions/ here (pyenv install 3.12 provides it)" >&2
  exit 1
fi
python -m pip install -q -c constraints.txt -e ".[test]"
# SkyRL's own log-prob functions, which tests/cpu/test_skyrl_parity.py compares with: its Megatron
# helpers need only torch, megatron-core and loguru, so the release comes without its GPU dependencies.
python -m pip install -q -c constraints.txt --no-deps skyrl loguru
ruff check .
ruff format --check .
python -m pytest tests/cpu -q
for release in 0.13.1 0.14.0 0.15.3; do
  env=".venvs/megatron-core-$release"
  [ -x "$env/bin/python" ] || python -m venv --system-site-packages "$env"
  "$env/bin/python" -m pip install -q -c constraints-older-megatron.txt "megatron-core==$release" numpy
  echo "integration tests on megatron-core $release"
  "$env/bin/python" -m pytest tests/cpu/test_integration_*.py -q
done
# torch for Python 3.12 is the CUDA build (4.7 GB): installed once, each release's environment
# reads it through a .pth file.
torch_env=.venvs/python3.12-torch
[ -x "$torch_env/bin/python" ] || "$python312" -m venv "$torch_env"
"$torch_env/bin/python" -m pip install -q -c constraints-python3.12.txt torch numpy pytest pyyaml
site_packages='import sysconfig; print(sysconfig.get_path("purelib"))'
torch_site=$("$torch_env/bin/python" -c "$site_packages")
for release in 0.17.1 0.18.2 0.19.2; do
  env=".venvs/megatron-core-$release"
  [ -x "$env/bin/python" ] || "$python312" -m venv "$env"
  echo "$torch_site" >"$("$env/bin/python" -c "$site_packages")/python3.12-torch.pth"
  "$env/bin/python" -m pip install -q -c constraints-python3.12.txt "megatron-core==$release"
  echo "integration tests on megatron-core $release (Python 3.12)"
  "$env/bin/python" -m pytest tests/cpu/test_integration_*.py -q
done
