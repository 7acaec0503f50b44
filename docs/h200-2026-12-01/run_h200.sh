#!/bin/bash
# Issue #14 on the H200 machine: `bash docs/h200-2026-12-01/run_h200.sh BUDGET_S` from the repo
# root, carrying .gpu-wheels/bin (+ the last kit part on the first call) and .wheels (mopt's
# wheels). The same command in every call of one warm machine: steps already done (markers in
# /tmp/res/done) are skipped, a step starts only when its estimate fits the budget left, and
# everything measured so far is packed into $OUT after each step (the .mopt store and build/
# stay on the machine between calls, so `mopt build` resumes where it stopped).
set -o pipefail
BUDGET=${1:-560}; START=$SECONDS; REPO=$PWD; D=$REPO/docs/h200-2026-12-01
R=/tmp/res; mkdir -p $R/done; export PYTHONUNBUFFERED=1
RECIPE=recipes/h200-serve.toml
left() { echo $(( BUDGET - (SECONDS - START) )); }
pack() { tar -C $R -czf $OUT/results.tgz --exclude=done . 2>/dev/null; cp $R/log.txt $OUT/ 2>/dev/null; }
# step NAME ESTIMATE_S CMD...: run CMD under a timeout of the budget left, once
step() {
  local name=$1 est=$2; shift 2
  [ -f $R/done/$name ] && { echo "== $name: done before"; return 0; }
  if [ "$(left)" -lt "$est" ]; then echo "== $name: skipped, $(left) s left < $est s"; return 1; fi
  echo "== $name (t=$((SECONDS-START)) s, $(left) s left)"; local s0=$SECONDS
  timeout -s INT -k 20 $(( $(left) - 5 )) bash -c '"$@"' _ "$@"; local rc=$?
  echo "$name rc=$rc $((SECONDS-s0)) s" | tee -a $R/times.txt
  [ $rc -eq 0 ] && touch $R/done/$name
  # a server left behind by an interrupted serve-check holds the GPU: end it, by its pid
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "ending leftover GPU process $pid"; kill -9 -- -$pid 2>/dev/null; kill -9 $pid 2>/dev/null; done
  pack; return $rc
}
setup() {
  bash .gpu-wheels/bin/install.sh --stretch || return 1
  python3 -m pip install -q --no-deps --no-index --force-reinstall .wheels/*.whl 2>&1 | grep -v WARNING | tail -3
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
  python3 -c "import vllm, modelopt, torch, transformers; print('vllm', vllm.__version__, 'modelopt', modelopt.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" | tee $R/versions.txt
  date -u | tee -a $R/versions.txt
}
build() {  # build SELECTOR...: one mopt build, its json and log kept under a name of the step
  local tag=$1; shift
  python3 -m mopt build -k -j 1 $RECIPE "$@" --json > $R/build-$tag.json 2> $R/build-$tag.err; local rc=$?
  grep -E "built|fail|rror|winner|knee|cosine" $R/build-$tag.err | tail -12
  cp -r .mopt/logs $R/mopt-logs 2>/dev/null
  for d in build/qwen3-shape/h200/*/; do n=$(basename "$d"); mkdir -p $R/art/$n
    cp "$d"/*.json "$d"/*.svg "$d"/*.yaml "$d"/*.html $R/art/$n/ 2>/dev/null
    [ -f "$d/server.log" ] && tail -c 60000 "$d/server.log" > $R/art/$n/server.log.tail; done
  return $rc
}
export -f setup build; export R RECIPE D OUT
{
source .gpu-wheels/bin/env.sh
step setup 60 setup || { pack; exit 1; }
step check 20 bash -c "python3 -m mopt check $RECIPE --json > $R/check.json; python3 -m mopt check $RECIPE > $R/check.txt 2>&1; tail -3 $R/check.txt"
step base 240 build base 'qwen3-shape.h200:serve-check'
step fp8 220 build fp8 'qwen3-shape.h200:serve-check-fp8'
for v in 'max_num_seqs=32,max_num_batched_tokens=4096' 'max_num_seqs=32,max_num_batched_tokens=16384' \
         'max_num_seqs=256,max_num_batched_tokens=4096' 'max_num_seqs=256,max_num_batched_tokens=16384'; do
  step "tuned-$v" 150 build "tuned-$v" "qwen3-shape.h200:serve-check-tuned?vllm-tuned@$v?"
done
step full 60 build full
step noop 30 bash -c "S0=\$(date +%s.%N); python3 -m mopt build $RECIPE --json > $R/build-noop.json 2> $R/build-noop.err; echo rc=\$? \$(python3 -c \"import time;print(round(time.time()-\$S0,2))\") s | tee $R/noop.txt; pgrep -fa 'vllm serve' | tee -a $R/noop.txt; tail -3 $R/build-noop.err"
step compare 170 python3 $D/compare.py build/qwen3-shape/h200/weights $R/compare.json
step compile 200 bash -c "sed 's/^mode = \"max-autotune\".*/mode = \"default\"/' recipes/h200-compile.toml > recipes/h200-compile-default.toml && python3 -m mopt build -k -j 1 recipes/h200-compile-default.toml 'qwen3-shape.h200:bench*' --json > $R/build-compile.json 2> $R/build-compile.err; rc=\$?; cp build/qwen3-shape/h200/bench*/bench.json $R/compile-bench.json 2>/dev/null; cp build/qwen3-shape/h200/torch-compile/meta.json $R/compile-meta.json 2>/dev/null; tail -5 $R/build-compile.err; exit \$rc"
step report 20 bash -c "python3 -m mopt report $RECIPE > $R/report.txt 2>&1; cp -r build/report* $R/ 2>/dev/null; ls build | tee -a $R/report.txt"
echo "== end of call (t=$((SECONDS-START)) s)"; cat $R/times.txt
} 2>&1 | tee -a $R/log.txt
pack
