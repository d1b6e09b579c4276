#!/usr/bin/env bash
# The test command of the README and of CI (.ci/run), for a fresh CPU machine with Python 3.11 and
# 3.12, with or without an active virtual environment.
#
# - The interpreter that runs `python` (the active virtual environment, or the machine's) gets the
#   pinned environment of constraints.txt; ruff checks the tracked files; the whole CPU suite runs
#   on the pinned megatron-core.
# - Each other supported release is installed, without dependencies, into its own small overlay
#   folder put first on PYTHONPATH, so that every release of one Python version shares that
#   version's one torch: 0.13 to 0.15 on top of the environment above, 0.17 to 0.19 (which need
#   Python >= 3.12) on top of one Python 3.12 environment under .venvs/. The integration tests run
#   on each, after a check that the release imported is the one installed.
# - Every environment pins torch, triton and pytest; pip keeps no cache. pytest-xdist spreads each
#   run over the machine's cores (-n auto). The environments other than the pinned one install
#   first, before ruff and the CPU suite: beside them, on CI's two cores, their writes (Python
#   3.12's CUDA torch is several GB) had slowed the suite from 6 to 13 minutes, and the whole run
#   took 22 minutes where one after the other takes 15 (docs/TESTING.md). pip compiles their bytecode as it
#   installs: where PYTHONDONTWRITEBYTECODE is set (the development machines set it), Python would
#   otherwise compile torch and Megatron anew in every process.
#
# - The trainers the recipes are tested against run as released, SkyRL 0.4.0 and verl 0.9.1 from
#   PyPI, in an overlay of their own with megatron-core 0.19.2 (constraints-trainers.txt).
# - Source checkouts named in the environment run too: NEMO_RL_SOURCE, SLIME_SOURCE and
#   SLIME_MEGATRON_SOURCE (the CPU suite's trainer tests run the trainers' own code from them, and
#   skip without them), MEGATRON_CORE_SOURCE (the integration tests on that Megatron-Core: main).
#
#   tests/run_cpu.sh            everything above
#   tests/run_cpu.sh --quick    the pinned environment, ruff and the CPU suite only
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
quick=false
case "${1:-}" in
  --quick) quick=true ;;
  "") ;;
  *) echo "usage: tests/run_cpu.sh [--quick]" >&2; exit 2 ;;
esac
started=$SECONDS
logs=$(mktemp -d)
installing=""
# A run that ends early (Ctrl-C) stops the installs too, their whole process group: an overlay left
# half-made is made again next time, and pip completes the Python 3.12 environment.
trap 'exit 130' INT TERM
trap '[ -n "$installing" ] && kill -- "-$installing" 2>/dev/null; rm -rf "$logs"' EXIT
summary=()

# $1: what ran, then the pytest command: run it, its output shown and kept, and its last line
# (pytest's count of passed, failed and skipped tests) added to the summary.
pytest_run() {
  local label=$1 log
  shift
  log="$logs/$(( ${#summary[@]} )).log"
  "$@" 2>&1 | tee "$log"
  summary+=("$label: $(tail -n 1 "$log" | tr -d '=' | sed 's/^ *//; s/ *$//'), done $(( (SECONDS - started) / 60 )) min into the run")
}

print_summary() {
  echo
  echo "tests/run_cpu.sh: passed in $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
  printf '  %s\n' "${summary[@]}"
}

# Found before the long suite runs, so that a machine without it fails at once. pyenv's python3.12
# shim is on PATH even where it only fails, hence each candidate is run.
python312=""
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    python312=$candidate
    break
  fi
done
if [ -z "$python312" ] && ! $quick; then
  echo "tests/run_cpu.sh: megatron-core 0.17 to 0.19 are tested on Python 3.12, which is neither python3.12" \
    "on PATH nor under ${PYENV_ROOT:-$HOME/.pyenv}/versions/ here (pyenv install 3.12 provides it)" >&2
  exit 1
fi

# $1: a Python interpreter, $2: the overlay folder of a megatron-core release, $3: that release,
# $4: further overlay folders, if any.
integration_tests() {
  local imported path="$2${4:+:$4}"
  # The release's own metadata, and its code imported from its folder (package_info.__version__
  # carries a git hash from 0.18 on).
  imported=$(PYTHONPATH="$path" "$1" -W ignore -c '
import importlib.metadata, os, sys
import megatron.core
folder = os.path.abspath(sys.argv[1]) + os.sep
inside = os.path.abspath(megatron.core.__file__).startswith(folder)
print(importlib.metadata.version("megatron-core") if inside else f"a copy outside {folder}")' "$2" 2>/dev/null |
    tail -n 1) || true
  if [ "$imported" != "$3" ]; then
    echo "tests/run_cpu.sh: $2 should give megatron-core $3, gave ${imported:-an import error}" >&2
    exit 1
  fi
  local where
  where="megatron-core $3, $("$1" -c 'import platform; print("Python", platform.python_version())')"
  echo "integration tests on $where"
  PYTHONPATH="$path" pytest_run "integration tests ($where)" "$1" -m pytest tests/cpu/test_integration_*.py -q -n auto --dist worksteal
}

# $1: a Python interpreter, $2: an overlay folder, $3: a constraints file, then what to install.
# Made once; a folder left half-made by an interrupted run is made again.
overlay() {
  local python=$1 folder=$2 constraints=$3
  shift 3
  [ -f "$folder/.complete" ] && return
  rm -rf "$folder"
  "$python" -m pip install -q --no-deps --target "$folder" -c "$constraints" "$@"
  touch "$folder/.complete"
}

# Every environment but the pinned one, each made once (a later run finds them under .venvs/):
# - the trainers the recipes are tested against, as released: SkyRL 0.4.0 and verl 0.9.1 with
#   megatron-core 0.19.2 in an overlay of their own (constraints-trainers.txt says what and why);
# - 0.13 to 0.15, which need numpy < 2 (one overlay for the three), over the pinned environment;
# - one Python 3.12 environment and 0.17 to 0.19 over it. PyPI's torch for Python 3.12 is the CUDA
#   build (constraints-python3.12.txt says why): torch, then each of its requirements in turn (pip
#   keeps a whole batch's downloads until the batch is installed, so one batch of its CUDA
#   libraries would hold their wheels and their files at once).
trainers=.venvs/python3.11/trainers
numpy1=.venvs/python3.11/numpy-1
env312=.venvs/python3.12/environment
python_env312="$env312/bin/python"
install_environments() {
  overlay python "$trainers" constraints-trainers.txt --ignore-requires-python -r constraints-trainers.txt
  overlay python "$numpy1" constraints-older-megatron.txt numpy
  for release in 0.13.1 0.14.0 0.15.3; do
    overlay python ".venvs/python3.11/megatron-core-$release" constraints-older-megatron.txt "megatron-core==$release"
  done
  [ -x "$python_env312" ] || "$python312" -m venv "$env312"
  local install=("$python_env312" -m pip install -q -c constraints-python3.12.txt)
  "${install[@]}" numpy packaging pytest pytest-xdist pyyaml
  "${install[@]}" --no-deps torch
  "$python_env312" -c '
import importlib.metadata
from packaging.requirements import Requirement
for line in importlib.metadata.requires("torch"):
    requirement = Requirement(line)
    if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
        print(requirement)' | while read -r requirement; do
    # Until the last one is in, pip's check of the installed set would report torch's others as
    # missing after each step: skipped here, and the finished environment checked below instead.
    "${install[@]}" --no-warn-conflicts "$requirement"
  done
  "$python_env312" -m pip check
  for release in 0.17.1 0.18.2 0.19.2; do
    overlay "$python_env312" ".venvs/python3.12/megatron-core-$release" constraints-python3.12.txt "megatron-core==$release"
  done
}

python -m pip install -q -c constraints.txt -e ".[test]"
if ! $quick; then
  set -m  # a process group of its own, which the exit trap can stop
  # A job waited for at once, not "if install_environments": errexit holds in the function only
  # where its call is no condition.
  { install_environments; echo $(( (SECONDS - started) / 60 )) >"$logs/installs.minutes"; } >"$logs/installs.log" 2>&1 &
  installing=$!
  set +m
  if ! wait "$installing"; then
    installing=""
    cat "$logs/installs.log" >&2
    echo "tests/run_cpu.sh: installing the other environments failed (its output above)" >&2
    exit 1
  fi
  installing=""
  summary+=("the other environments (.venvs/): ready $(cat "$logs/installs.minutes") min into the run")
fi
# Tracked files only: a scratch file of the user's in the clone is not the project's.
git ls-files -z '*.py' | xargs -0 ruff check --force-exclude
git ls-files -z '*.py' | xargs -0 ruff format --check --force-exclude
summary+=("ruff check and format: clean")
pinned="megatron-core $(python -c 'import importlib.metadata as m; print(m.version("megatron-core"))')"
pinned+=", torch $(python -c 'import torch; print(torch.__version__)')"
pinned+=", $(python -c 'import platform; print("Python", platform.python_version())')"
pytest_run "CPU suite ($pinned)" python -m pytest tests/cpu -q -n auto --dist worksteal
if $quick; then
  print_summary
  exit 0
fi

imported=$(PYTHONPATH="$trainers" python -W ignore -c 'import megatron.core, skyrl, verl, importlib.metadata as m
print(m.version("megatron-core"), m.version("skyrl"), m.version("verl"))' 2>/dev/null | tail -n 1) || true
if [ "$imported" != "0.19.2 0.4.0 0.9.1" ]; then
  echo "tests/run_cpu.sh: $trainers should give megatron-core 0.19.2, SkyRL 0.4.0 and verl 0.9.1, gave ${imported:-an import error}" >&2
  exit 1
fi
PYTHONPATH="$trainers" pytest_run "the trainers' own code (SkyRL 0.4.0, verl 0.9.1, megatron-core 0.19.2)" \
  python -m pytest tests/cpu/test_trainer_skyrl.py tests/cpu/test_trainer_verl.py tests/cpu/test_skyrl_parity.py -q \
  -n auto --dist worksteal

# A source checkout of Megatron-Core named in the environment (main, say): the integration tests on it.
if [ -n "${MEGATRON_CORE_SOURCE:-}" ]; then
  from_source=$(PYTHONPATH="$MEGATRON_CORE_SOURCE" python -W ignore -c 'import os, sys, megatron.core
from megatron.core import package_info
inside = os.path.abspath(megatron.core.__file__).startswith(os.path.abspath(sys.argv[1]) + os.sep)
print(package_info.__version__ if inside else "a copy outside it")' "$MEGATRON_CORE_SOURCE" 2>/dev/null | tail -n 1) || true
  PYTHONPATH="$MEGATRON_CORE_SOURCE" pytest_run "integration tests (megatron-core $from_source from $MEGATRON_CORE_SOURCE)" \
    python -m pytest tests/cpu/test_integration_*.py -q -n auto --dist worksteal
fi

for release in 0.13.1 0.14.0 0.15.3; do
  integration_tests python ".venvs/python3.11/megatron-core-$release" "$release" "$numpy1"
done
for release in 0.17.1 0.18.2 0.19.2; do
  integration_tests "$python_env312" ".venvs/python3.12/megatron-core-$release" "$release"
done
print_summary
