#!/usr/bin/env bash
# Every GPU step of kvsim in one command, outputs named by device under reports/:
#   scripts/gpu_run.sh                 all steps: env tests bench profile replay plot
#   scripts/gpu_run.sh bench profile   only those steps (split the run when one call has a time limit)
# Writes reports/gpu-<device>/<step>.log, reports/bench/kernels-<device>.csv (+ its charts),
# reports/profile/<device>/ and reports/poisson-<device>/. A failing step is logged and the next one runs;
# the exit status is the number of failed steps. When $OUT is set (the device tool's return folder), the
# outputs are packed there as gpu-run-<device>.tar.gz (unpack at the repo root; over 15 MiB it comes in parts
# gpu-run-<device>.tar.gz.part-0, -1, ...: cat them into one), with the logs beside it.
# Outputs are packed after every step, so a call cut off by the device tool still returns the steps it finished.
# Env: BENCH_ARGS / PROFILE_ARGS / REPLAY_ARGS add options to a step; SNAPSHOT=1 dumps CUDA memory snapshots
# in the profile; STEP_TIMEOUT (s, default 540) caps each step; TOTAL_TIMEOUT (s) caps the whole run (set it a
# little under the device tool's per-call limit: each step gets what is left, minus a margin to pack).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a step killed at its time limit still leaves its output in its log
PY=${PYTHON:-python3}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests bench profile replay plot)

slug=$($PY -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name(0).lower()).strip('-'))" 2>/dev/null) || {
  echo "gpu_run: torch sees no CUDA device" >&2
  exit 1
}
logs="reports/gpu-$slug"
mkdir -p "$logs"
failed=0
PACK_MARGIN=25  # s kept back from TOTAL_TIMEOUT: a killed step's 10 s grace, then packing

pack() {  # the outputs so far -> $OUT (when set): one archive and the logs, rewritten after every step
  local outputs=() path
  for path in "$logs" reports/bench/*"kernels-$slug".* "reports/profile/$slug" "reports/poisson-$slug"; do
    [ -e "$path" ] && outputs+=("$path")
  done
  if [ -n "${OUT:-}" ] && [ ${#outputs[@]} -gt 0 ]; then
    # One archive (the device tool returns few files, two folders deep at most), plus the logs to read at once.
    # It returns no file over 16 MiB, so a larger archive comes back in 15 MiB parts (cat them to unpack).
    local archive="$OUT/gpu-run-$slug.tar.gz"
    rm -f "$archive" "$archive".part-*
    tar -czf "$archive" "${outputs[@]}"
    if [ "$(stat -c %s "$archive")" -gt $((15 * 1024 * 1024)) ]; then
      split -b 15M -d -a 1 "$archive" "$archive.part-" && rm -f "$archive"
    fi
    cat "$logs"/*.log >"$OUT/gpu-run-$slug.log"
  fi
  packed="${outputs[*]}"
}

run_step() {  # name, command...: run with a time cap, tee to the step's log, count failures, pack
  local name=$1
  shift
  local cap=${STEP_TIMEOUT:-540}
  if [ -n "${TOTAL_TIMEOUT:-}" ]; then
    local left=$((TOTAL_TIMEOUT - SECONDS - PACK_MARGIN))
    [ "$left" -lt "$cap" ] && cap=$left
  fi
  if [ "$cap" -le 0 ]; then
    echo "== $name: not run: TOTAL_TIMEOUT=${TOTAL_TIMEOUT}s is spent" | tee "$logs/$name.log"
    failed=$((failed + 1))
    return
  fi
  echo "== $name (at most ${cap} s): $*" | tee "$logs/$name.log"
  local start=$SECONDS
  timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$logs/$name.log"
  local rc=${PIPESTATUS[0]}
  local why=""
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && why=" (time limit)"  # 137: killed 10 s after the TERM
  echo "== $name: exit $rc$why after $((SECONDS - start)) s" | tee -a "$logs/$name.log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  pack
}

for step in "${steps[@]}"; do
  case $step in
    env)
      run_step env bash -c "nvidia-smi; $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__); print(torch.cuda.get_device_properties(0))'"
      ;;
    tests)  # the GPU-marked tests only; modules needing a package the image lacks are reported, not fatal
      run_step tests $PY -m pytest -q -m gpu --continue-on-collection-errors -p no:cacheprovider tests/
      ;;
    bench)
      run_step bench $PY -m kvsim bench kernels --model llama-3.1-8b --device cuda --out reports/bench ${BENCH_ARGS:-}
      ;;
    profile)
      run_step profile $PY -m kvsim profile workloads/poisson.yaml --out "reports/profile/$slug" \
        ${SNAPSHOT:+--snapshot} ${PROFILE_ARGS:-}
      ;;
    replay)
      # The roofline clock (as the CPU reports use): every step writes on the GPU and every 100th decode step
      # reads (REPLAY_ARGS="--read-every 1" for all of them), timed by CUDA events resolved once after the loop,
      # so no host sync inside it (--timing measured waits on each step's events).
      # Its summary.csv byte figures then match reports/poisson/ exactly. REPLAY_ARGS="--timing measured" switches
      # to the measured clock.
      run_step replay $PY -m kvsim replay workloads/poisson.yaml --device cuda \
        --out "reports/poisson-$slug" ${REPLAY_ARGS:-}
      ;;
    plot)  # charts next to the kernel CSVs and the replay report (those that exist)
      dirs=()
      for dir in reports/bench "reports/poisson-$slug"; do [ -d "$dir" ] && dirs+=("$dir"); done
      if [ ${#dirs[@]} -eq 0 ]; then  # `kvsim plot` with no folder would redraw every report under reports/
        echo "== plot: nothing to plot (no bench CSV or replay report from this run)" | tee "$logs/plot.log"
        pack
      else
        run_step plot $PY -m kvsim plot "${dirs[@]}"
      fi
      ;;
    *)
      echo "gpu_run: unknown step '$step' (env, tests, bench, profile, replay, plot)" >&2
      failed=$((failed + 1))
      ;;
  esac
done

pack
echo "gpu_run: ${#steps[@]} step(s), $failed failed; outputs: $packed"
exit "$failed"
