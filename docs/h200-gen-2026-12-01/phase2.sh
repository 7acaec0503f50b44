#!/bin/bash
# Phase 2 on the H200 (issue #16 item 5): `bash docs/h200-gen-2026-12-01/phase2.sh BUDGET_S` from the
# repo root after the kit's stash runs, carrying .gpu-wheels/bin (+ p04 when the same call stashes it)
# and .wheels (mopt's wheels, built from this tree). `mopt build` of the h200 section of
# recipes/qwen3-chat.toml from an empty store; then, budget permitting, the #14 comparison.
# Same budget/step/pack driver as phase1.sh; re-runnable on a warm machine (mopt build resumes).
set -o pipefail
BUDGET=${1:-560}; START=$SECONDS; REPO=$PWD; D=$REPO/docs/h200-gen-2026-12-01
R=/tmp/res2; mkdir -p $R/done; export PYTHONUNBUFFERED=1
RECIPE=recipes/qwen3-chat.toml; SEC=qwen3-chat-0-6b.h200
left() { echo $(( BUDGET - (SECONDS - START) )); }
pack() { tar -C $R -czf $OUT/results.tgz --exclude=done . 2>/dev/null; cp $R/log.txt $OUT/ 2>/dev/null; }
step() {
  local name=$1 est=$2; shift 2
  [ -f $R/done/$name ] && { echo "== $name: done before"; return 0; }
  if [ "$(left)" -lt "$est" ]; then echo "== $name: skipped, $(left) s left < $est s"; return 1; fi
  echo "== $name (t=$((SECONDS-START)) s, $(left) s left)"; local s0=$SECONDS
  timeout -s INT -k 15 $(( $(left) - 8 )) bash -c '"$@"' _ "$@"; local rc=$?
  echo "$name rc=$rc $((SECONDS-s0)) s" | tee -a $R/times.txt
  [ $rc -eq 0 ] && touch $R/done/$name
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "ending leftover GPU process $pid"; kill -9 $pid 2>/dev/null; done
  collect; pack; return $rc
}
collect() {  # the section's small outputs, after every step
  cp -r .mopt/logs $R/mopt-logs 2>/dev/null
  for d in build/qwen3-chat-0-6b/h200/*/; do [ -d "$d" ] || continue; n=$(basename "$d"); mkdir -p $R/art/$n
    cp "$d"/*.json "$d"/*.svg "$d"/*.yaml "$d"/*.sh "$d"/*.html $R/art/$n/ 2>/dev/null
    [ -d "$d/bench" ] && cp -r "$d/bench" $R/art/$n/ 2>/dev/null
    [ -f "$d/server.log" ] && grep -v '"GET /metrics\|POST /v1\|POST /tokenize\|Route:' "$d/server.log" | tail -c 60000 > $R/art/$n/server.log.txt
    rm -f $R/art/$n/model.safetensors* $R/art/$n/tokenizer.json; done
}
setup() {
  bash .gpu-wheels/bin/install.sh --stretch || return 1
  python3 -m pip install -q --no-deps --no-index --force-reinstall .wheels/*.whl 2>&1 | grep -v WARNING | tail -3
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
  python3 -c "import vllm, modelopt, torch, transformers; print('vllm', vllm.__version__, 'modelopt', modelopt.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" | tee $R/versions.txt
  python3 -m mopt plugins 2>&1 | tail -12 > $R/plugins.txt; date -u | tee -a $R/versions.txt; nproc | tee -a $R/versions.txt
}
gen() {
  python3 -m mopt build -k -j 1 $RECIPE "$SEC" --json > $R/build.json 2> $R/build.err; local rc=$?
  grep -E "built|fail|rror|winner|knee|top-1|TTFT|prefix|start-up" $R/build.err | tail -40
  return $rc
}
export -f setup gen collect; export R D OUT RECIPE SEC
{
source .gpu-wheels/bin/env.sh
step setup 60 setup || { pack; exit 1; }
step check 20 bash -c "python3 -m mopt check $RECIPE '$SEC' --json > $R/check.json; python3 -m mopt check $RECIPE '$SEC' > $R/check.txt 2>&1; tail -4 $R/check.txt"
step gen 300 gen
step report 20 bash -c "python3 -m mopt report $RECIPE > $R/report.txt 2>&1; cp -r build/report* $R/ 2>/dev/null; python3 -m mopt ls $RECIPE '$SEC' >> $R/report.txt 2>&1; tail -5 $R/report.txt"
step noop 40 bash -c "S0=\$(date +%s.%N); python3 -m mopt build $RECIPE '$SEC' --json > $R/build-noop.json 2> $R/build-noop.err; echo rc=\$? \$(python3 -c \"import time;print(round(time.time()-\$S0,2))\") s | tee $R/noop.txt; pgrep -fa 'vllm serve' | tee -a $R/noop.txt; tail -3 $R/build-noop.err"
step compare 190 bash -c "python3 -m mopt build recipes/h200-serve.toml 'qwen3-shape.h200:weights' 2>&1 | tail -2 && python3 $REPO/docs/h200-2026-12-01/compare.py build/qwen3-shape/h200/weights $R/compare.json"
echo "== end of call (t=$((SECONDS-START)) s)"; cat $R/times.txt
} 2>&1 | tee -a $R/log.txt
pack
