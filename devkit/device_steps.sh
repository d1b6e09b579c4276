#!/usr/bin/env bash
# Resumable steps for one device call (the `device` tool's `run`): GPU starts are scarce and a call
# lasts at most 10 minutes, so a session's GPU work is one script of steps in priority order, run
# again on the same warm machine until every step is done. Source this file from that script, with
# the call's budget in seconds:
#
#   source devkit/device_steps.sh 585
#   step bench 60 "python3 benchmarks/bench_logprob.py ... --json $KEEP/bench.json"
#   step parity 150 "python3 -m pytest tests/gpu/test_loss_parity.py --junitxml=$KEEP/parity.xml"
#   finish                                     # copies $KEEP to $OUT
#
# `step NAME SECONDS COMMAND` runs COMMAND in bash (output in $KEEP/NAME.txt; KEEP is exported)
# unless an earlier call on this machine finished it (/tmp/device_steps/done/NAME: by name, so a
# step whose command changed between calls needs a new name) or fewer than SECONDS of the budget
# are left; its time limit is what is left, less 5 s. $KEEP/times.txt logs each step's exit status
# and time. A failing step never stops the script, under `set -e` too. /tmp outlives a call only
# while the machine stays warm (30 s idle), so the next call must follow at once; on a fresh
# machine every step runs again.

DEVICE_STEPS_START=$(date +%s)
DEVICE_STEPS_BUDGET=${1:?"source devkit/device_steps.sh SECONDS (the call's budget)"}
export KEEP=/tmp/device_steps/keep
mkdir -p /tmp/device_steps/done "$KEEP"

seconds_left() {
  echo $((DEVICE_STEPS_BUDGET - ($(date +%s) - DEVICE_STEPS_START)))
}

step() {
  local name=$1 needed=$2 limit status=0
  shift 2
  [ -e "/tmp/device_steps/done/$name" ] && return 0
  limit=$(($(seconds_left) - 5))
  if [ "$limit" -lt "$needed" ] || [ "$limit" -le 0 ]; then
    echo "$name not started: $(seconds_left) s left, $needed needed" >>"$KEEP/times.txt"
    return 0
  fi
  timeout -k 5 "$limit" bash -c "$*" >"$KEEP/$name.txt" 2>&1 || status=$?
  echo "$name exit $status at $(($(date +%s) - DEVICE_STEPS_START)) s ($(date -u +%H:%M:%S) UTC)" >>"$KEEP/times.txt"
  if [ "$status" -eq 0 ]; then
    touch "/tmp/device_steps/done/$name"
  fi
  return 0
}

finish() {
  cp -r "$KEEP/." "${OUT:?"finish copies to the device call's output folder, \$OUT"}/"
  cat "$KEEP/times.txt" 2>/dev/null || true
}
