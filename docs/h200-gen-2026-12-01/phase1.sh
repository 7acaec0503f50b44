#!/bin/bash
# Phase 1 on the H200 (issues #16 item 5 probe, #14 leftovers): `bash docs/h200-gen-2026-12-01/phase1.sh BUDGET_S`
# from the repo root, after the kit's stash runs, carrying .gpu-wheels/bin (+ p04 when the same call
# stashes it) and .wheels. Steps in priority order, each under a timeout of the budget left, skipped
# when its estimate does not fit; results packed into $OUT after every step. Re-runnable on a warm
# machine (done steps are skipped).
set -o pipefail
BUDGET=${1:-560}; START=$SECONDS; REPO=$PWD; D=$REPO/docs/h200-gen-2026-12-01
R=/tmp/res; mkdir -p $R/done $R/gen; export PYTHONUNBUFFERED=1
G=/tmp/gen
left() { echo $(( BUDGET - (SECONDS - START) )); }
pack() { tar -C $R -czf $OUT/results.tgz --exclude=done --exclude='*.safetensors' . 2>/dev/null; cp $R/log.txt $OUT/ 2>/dev/null; }
step() {
  local name=$1 est=$2; shift 2
  [ -f $R/done/$name ] && { echo "== $name: done before"; return 0; }
  if [ "$(left)" -lt "$est" ]; then echo "== $name: skipped, $(left) s left < $est s"; return 1; fi
  echo "== $name (t=$((SECONDS-START)) s, $(left) s left)"; local s0=$SECONDS
  timeout -s INT -k 15 $(( $(left) - 5 )) bash -c '"$@"' _ "$@"; local rc=$?
  echo "$name rc=$rc $((SECONDS-s0)) s" | tee -a $R/times.txt
  [ $rc -eq 0 ] && touch $R/done/$name
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "ending leftover GPU process $pid"; kill -9 $pid 2>/dev/null; done
  pack; return $rc
}
setup() {
  bash .gpu-wheels/bin/install.sh --stretch || return 1
  python3 -m pip install -q --no-deps --no-index --force-reinstall .wheels/*.whl 2>&1 | grep -v WARNING | tail -3
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
  python3 -c "import vllm, modelopt, torch, transformers; print('vllm', vllm.__version__, 'modelopt', modelopt.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" | tee $R/versions.txt
  date -u | tee -a $R/versions.txt; nproc | tee -a $R/versions.txt
}
h14() {
  local s0=$(date +%s)
  python3 -m mopt build -k -j 1 recipes/h200-serve.toml 'qwen3-shape.h200:serve-check' --json > $R/h14-build.json 2> $R/h14-build.err; local rc=$?
  echo "h14 build rc=$rc $(( $(date +%s) - s0 )) s"; grep -E "built|fail|rror|knee|cosine|vllm bench|tool" $R/h14-build.err | tail -20
  mkdir -p $R/h14; d=build/qwen3-shape/h200/serve-check; cp $d/*.json $d/*.svg $R/h14/ 2>/dev/null
  [ -f $d/server.log ] && tail -c 40000 $d/server.log > $R/h14/server.log.tail
  cp .mopt/logs/* $R/h14/ 2>/dev/null; ls -R .mopt/logs 2>/dev/null | tail -3
  return $rc
}
export -f setup h14; export R D G OUT
{
source .gpu-wheels/bin/env.sh
step setup 60 setup || { pack; exit 1; }
step genmodel 40 python3 $D/make_model.py $G/bf16
step genserve 180 python3 $D/probe_gen.py serve $G/bf16 $R/gen --label bf16 --prefix
step genref 25 python3 $D/probe_gen.py reference $G/bf16 $R/gen bf16
for f in fp8 int4_awq int8_sq; do
  step "export-$f" 30 python3 $D/quant_gen.py export-one $G/bf16 recipes/data/serve-calib.txt $f $G/q-$f $R/gen
done
step load-int4_awq 20 python3 $D/quant_gen.py vllm-load $G/q-int4_awq int4_awq $R/gen
step load-int8_sq 20 python3 $D/quant_gen.py vllm-load $G/q-int8_sq int8_sq $R/gen
step load-fp8 70 python3 $D/quant_gen.py vllm-load $G/q-fp8 fp8 $R/gen
step fp8ref 25 python3 $D/probe_gen.py reference $G/bf16 $R/gen fp8
step h14 200 h14
step compare 170 python3 $REPO/docs/h200-2026-12-01/compare.py build/qwen3-shape/h200/weights $R/compare.json
step noprefix 140 python3 $D/probe_gen.py serve $G/bf16 $R/gen --label bf16-noprefix --extra "--no-enable-prefix-caching" --sweep "" --prefix
echo "== end of call (t=$((SECONDS-START)) s)"; cat $R/times.txt
} 2>&1 | tee -a $R/log.txt
pack
