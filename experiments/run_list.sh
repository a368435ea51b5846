#!/usr/bin/env bash
# Runs every line of a run list ("NAME key=value ...") with configs/reference.yaml, JOBS at a time, each in
# runs/<list name>/NAME. Finished runs (summary.json) are skipped; interrupted ones resume from their
# checkpoint, so the script can be rerun after a crash or the end of a session.
# Usage: experiments/run_list.sh experiments/comparison.runs [JOBS]
set -u
cd "$(dirname "$0")/.."
list=$1; jobs=${2:-2}
root=runs/$(basename "$list" .runs)
mkdir -p "$root"
run_one() {
  name=$1; shift
  dir=$root/$name
  [ -f "$dir/summary.json" ] && return 0
  if .venv/bin/fedlase run configs/reference.yaml "$@" out="$dir" --resume --quiet > "$root/$name.log" 2>&1; then
    echo "done $name"
  else
    echo "FAILED $name (see $root/$name.log)"
  fi
}
export -f run_one; export root
grep -v '^\s*#' "$list" | sed '/^\s*$/d' | xargs -P "$jobs" -L 1 bash -c 'run_one "$@"' _
