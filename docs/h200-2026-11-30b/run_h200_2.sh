#!/bin/bash
# Issue #6, run 2 on the H200 machine: the mopt chain of recipes/h200-compile.toml as committed
# (torch-compile mode=max-autotune, sdpa_backend=cudnn, rope_table=true -> validate -> bench),
# a no-op rebuild, a fresh-process warm start (warm.py), then, if time is left, mode=default with
# the same settings through the compile worker (cold compile + ms/batch) for the mode comparison.
set -o pipefail
REPO=$PWD; D=$REPO/docs/h200-2026-11-30b; R=/tmp/res; rm -rf $R; mkdir -p $R
export PYTHONUNBUFFERED=1
START=$SECONDS
pack() { tar -C $R -czf $OUT/results.tgz . 2>/dev/null; }
left() { echo $(( 500 - (SECONDS - START) )); }
{
python3 -m pip install -q --force-reinstall --no-deps --no-index .wheels/check-helper/*.whl .wheels/mopt/*.whl 2>&1 | grep -v WARNING | tail -3
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
rm -rf /tmp/p; mkdir -p /tmp/p && cp -r recipes mopt.toml /tmp/p/ && cd /tmp/p
cp recipes/h200-compile.toml $R/recipe-as-built.toml
echo "== build1 (t=$((SECONDS-START)) s)"
S0=$SECONDS
timeout $(( $(left) - 60 )) python3 -m mopt build -j 1 -k recipes/h200-compile.toml --json > $R/build1.json 2> $R/build1.err
echo "build1 rc=$? $((SECONDS-S0)) s" | tee -a $R/times.txt; tail -6 $R/build1.err
S0=$SECONDS
timeout 30 python3 -m mopt build -j 1 recipes/h200-compile.toml --json > $R/build2.json 2> $R/build2.err
echo "build2 rc=$? $((SECONDS-S0)) s" | tee -a $R/times.txt
timeout 20 python3 -m mopt report recipes/h200-compile.toml --json > $R/report.json 2>&1
B=build/qwen3-shape/h200
cp $B/torch-compile/meta.json $R/meta.json; cp $B/validate/report.json $R/validate.json; cp $B/bench/bench.json $R/bench.json
cp -r .mopt/logs $R/mopt-logs 2>/dev/null
head -c 2500 $R/meta.json; echo; pack
echo "== warm start in a fresh process (t=$((SECONDS-START)) s, $(left) s left)"
if [ $(left) -gt 40 ]; then
  timeout $(( $(left) )) python3 $D/warm.py $B/weights $B/torch-compile $R/warm.json > $R/warm.log 2>&1
  echo "warm rc=$?"; grep -v Warning $R/warm.log | head -40
fi
pack
echo "== mode=default, same settings, compile worker (t=$((SECONDS-START)) s, $(left) s left)"
if [ $(left) -gt 95 ]; then
  mkdir -p /tmp/d/out && cd /tmp/d
  python3 -c "
import json; m = json.load(open('$R/meta.json'))
json.dump({'weights': '/tmp/p/$B/weights', 'out': '/tmp/d/out', 'device': 'cuda', 'family': m['family'],
  'pooling': m['pooling'], 'precision': 'fp16', 'mode': 'default', 'buckets': [[32, 512]], 'attention': m['attention'],
  'sdpa_backend': m['sdpa_backend'], 'rope_table': m['rope_table'], 'fullgraph': False, 'warmup': 3, 'iters': 20,
  'min_cosine': 0.999, 'seed': 0}, open('spec.json', 'w'))"
  SECONDS0=$SECONDS
  TORCHINDUCTOR_CACHE_DIR=/tmp/d/ind TRITON_CACHE_DIR=/tmp/d/tri timeout $(( $(left) )) python3 -m mopt_torch.compile_worker spec.json > $R/default-worker.log 2>&1
  echo "default worker rc=$? $((SECONDS-SECONDS0)) s"; tail -3 $R/default-worker.log; cp out/meta.json $R/default-meta.json
fi
echo "== done (t=$((SECONDS-START)) s)"
} 2>&1 | tee $R/log.txt
cp $R/log.txt $OUT/log.txt; pack
