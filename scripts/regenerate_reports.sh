#!/usr/bin/env bash
# Regenerate every report shipped under reports/, each with the command that produced it (a replay's is the
# `command` in its meta.json), then its charts. Run from anywhere; rerun after any change that moves a figure.
#
#   bash scripts/regenerate_reports.sh            # everything (about 10-20 min on a 2-core machine)
#   bash scripts/regenerate_reports.sh poisson sweeps/block-size-x-budget   # only these (names under reports/)
#
# Each report is written in place; a rerun on the same tree gives the same tracked bytes (host.json and
# kernels.* are this host's measurements and are git-ignored). KVSIM overrides how kvsim is run (default
# `python3 -m kvsim` with this checkout first on PYTHONPATH); SHARED is the folder holding the full traces
# (default ../shared, beside the clone) for the cache-curve report, skipped with a note when it is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
KVSIM=${KVSIM:-python3 -m kvsim}
SHARED=${SHARED:-../shared}

# name under reports/ -> the arguments after `kvsim` (replays as their meta.json records them)
declare -A REPORTS=(
  [poisson]="replay workloads/poisson.yaml"
  [sharegpt-like]="replay workloads/sharegpt-like.yaml --quiet"
  [alpaca-like]="replay workloads/alpaca-like.yaml --quiet"
  [block-sizes]="replay workloads/block-sizes.yaml --quiet"
  [shared-prefix]="replay workloads/shared-prefix.yaml --quiet"
  [sliding-window]="replay workloads/sliding-window.yaml --quiet --no-tensors"
  [mooncake-conversation]="replay workloads/mooncake-conversation.yaml --quiet --no-tensors"
  [prefix-block-sizes]="replay workloads/prefix-block-sizes.yaml --quiet --no-tensors"
  [mooncake-conversation-offload-256GiB]="replay workloads/mooncake-conversation-offload.yaml --no-tensors -q --cpu-offload 256GiB --out reports/mooncake-conversation-offload-256GiB"
  [sweeps/block-size-x-budget]="sweep workloads/sweeps/block-size-x-budget.yaml --csv -q"
  [sweeps/rate-x-allocator-capacity]="sweep workloads/sweeps/rate-x-allocator-capacity.yaml --csv -q"
  [sweeps/model-x-gpu-x-dtype]="sweep workloads/sweeps/model-x-gpu-x-dtype.yaml --csv -q"
  [cache-curve-cpu-tier]="cache-curve $SHARED/traces/mooncake/conversation_trace.jsonl -m llama-3.1-8b --gpu h100-80gb --cpu-capacities 524288,2097152,8388608 --out reports/cache-curve-cpu-tier"
  [size]="plot size --model qwen3-8b --model gemma-3-27b --model gpt-oss-120b --model qwen3-next-80b-a3b"
)
ORDER=(poisson sharegpt-like alpaca-like block-sizes shared-prefix sliding-window mooncake-conversation
       prefix-block-sizes mooncake-conversation-offload-256GiB sweeps/block-size-x-budget
       sweeps/rate-x-allocator-capacity sweeps/model-x-gpu-x-dtype cache-curve-cpu-tier size)

names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${ORDER[@]}")
for name in "${names[@]}"; do
  args=${REPORTS[$name]:-}
  if [ -z "$args" ]; then
    echo "unknown report '$name' (known: ${ORDER[*]})" >&2
    exit 2
  fi
  if [ "$name" = cache-curve-cpu-tier ] && [ ! -f "$SHARED/traces/mooncake/conversation_trace.jsonl" ]; then
    echo "== $name: skipped ($SHARED/traces/mooncake/conversation_trace.jsonl is absent; set SHARED)" >&2
    continue
  fi
  case $name in sweeps/*) rm -f "reports/$name/rows.jsonl" ;; esac  # a sweep resumes from its journal: start afresh
  echo "== $name: kvsim $args" >&2
  start=$(date +%s)
  if [ "$name" = poisson ]; then
    $KVSIM $args >/dev/null  # the README's first command, as a user runs it (table and all)
  else
    $KVSIM $args
  fi
  case $name in
    size|cache-curve-cpu-tier) ;;  # their command draws their charts
    *) $KVSIM plot "reports/$name" >/dev/null ;;
  esac
  echo "   $name: $(( $(date +%s) - start )) s" >&2
done
