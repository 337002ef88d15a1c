#!/usr/bin/env bash
# Timed steps for the GPU scripts in this folder (sourced, not run): each step is one command
# with a time limit whose raw output goes to its own log, so one failing or hanging step is
# recorded and the next one runs anyway.
#
#   source "$(dirname "$0")/steps.sh"
#   steps_init OUT_DIR [TAIL_LINES]    # OUT_DIR must exist; TAIL_LINES of each log echoed (default 3)
#   step NAME LIMIT_SECONDS COMMAND... # run COMMAND in the current directory
#   skip_step NAME REASON              # record a step that was not run
#   fence FILE...                      # the files inside a markdown code fence
#
# A step is stopped with SIGINT at its limit (so pytest still writes its JSON), SIGKILL 10 s
# later. Records, in OUT_DIR: commands.txt ("== NAME (limit Ns): COMMAND"), exit_codes.txt
# ("NAME rc=RC seconds=S"), steps.txt ("NAME RC SECONDS LIMIT" or "NAME skipped - REASON"),
# NAME.log (the raw output). steps_failed is 1 once any step failed.

steps_init() {
  steps_out=$1
  steps_tail=${2:-3}
  steps_failed=0
  : > "$steps_out/commands.txt"
  : > "$steps_out/exit_codes.txt"
  : > "$steps_out/steps.txt"
}

step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local start rc seconds
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*" | tee -a "$steps_out/commands.txt"
  timeout -s INT -k 10 "$limit" "$@" > "$steps_out/$name.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  [ "$rc" -eq 0 ] || steps_failed=1
  echo "$name $rc $seconds $limit" >> "$steps_out/steps.txt"
  echo "$name rc=$rc seconds=$seconds" | tee -a "$steps_out/exit_codes.txt"
  tail -n "$steps_tail" "$steps_out/$name.log"
}

skip_step() {  # skip_step NAME REASON
  echo "$1 skipped: $2"
  echo "$1 skipped - $2" >> "$steps_out/steps.txt"
}

fence() { echo '```'; cat "$@" 2>/dev/null; echo '```'; }

usage_from_header() {  # usage_from_header SCRIPT: its opening comment, for --help
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$1"
}
