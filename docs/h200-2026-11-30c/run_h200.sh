#!/bin/bash
# Issue #6, round c, one call on the H200 machine: recipes/h200-compile.toml with mode = "default"
# (sdpa_backend = "cudnn", rope_table = true kept; the mode line is changed in a copy of the
# recipe under /tmp/p), built from empty stores: weights -> torch-compile (cold compile) ->
# validate (min cosine vs fp32) -> bench (compiled vs eager fp16, same run); then a no-op
# rebuild and a fresh-process warm start (warm.py, empty Inductor/Triton caches).
# Every step has a timeout; results are packed into $OUT/results.tgz after each step.
set -o pipefail
REPO=$PWD; D=$REPO/docs/h200-2026-11-30c; R=/tmp/res; rm -rf $R; mkdir -p $R
export PYTHONUNBUFFERED=1
START=$SECONDS
pack() { cp $R/log.txt $OUT/log.txt 2>/dev/null; tar -C $R -czf $OUT/results.tgz . 2>/dev/null; }
left() { echo $(( 470 - (SECONDS - START) )); }
{
timeout 60 python3 -m pip install -q --force-reinstall --no-deps --no-index .wheels/check-helper/*.whl .wheels/mopt/*.whl 2>&1 | grep -v WARNING | tail -3
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
rm -rf /tmp/p; mkdir -p /tmp/p && cp -r recipes mopt.toml /tmp/p/ && cd /tmp/p
sed -i 's/^mode = "max-autotune".*/mode = "default"/' recipes/h200-compile.toml
cp recipes/h200-compile.toml $R/recipe-as-built.toml; grep -E '^(mode|sdpa_backend|rope_table) ' $R/recipe-as-built.toml
echo "== build1 mode=default (t=$((SECONDS-START)) s)"
S0=$SECONDS
timeout $(( $(left) - 70 )) python3 -m mopt build -j 1 -k recipes/h200-compile.toml --json > $R/build1.json 2> $R/build1.err
echo "build1 rc=$? $((SECONDS-S0)) s" | tee -a $R/times.txt; grep -E 'built|fail|rror' $R/build1.err | tail -8
B=build/qwen3-shape/h200
cp $B/torch-compile/meta.json $R/meta.json; cp $B/validate/report.json $R/validate.json; cp $B/bench/bench.json $R/bench.json
ls -la $B/torch-compile/ > $R/artifact-ls.txt 2>&1
cp -r .mopt/logs $R/mopt-logs 2>/dev/null
python3 - $R <<'PY' 2>&1 | tee $R/summary.txt
import json, sys
R = sys.argv[1]
try:
    m = json.load(open(f"{R}/meta.json")); print("meta:", m["mode"], m["sdpa_backend"], m["rope_table"], "compile_seconds", m["compile_seconds"], "process_seconds", m["process_seconds"], m["buckets"], "cache_bytes", m["cache_bytes"], m["cache_entries"])
    b = json.load(open(f"{R}/bench.json"))
    for r in b["results"]:
        for p in r["points"]:
            print("bench:", r["label"], p["batch"], p["seq"], "p50", round(p["p50_ms"], 3), "mean", round(p["mean_ms"], 3), "load_s", round(r["load_seconds"], 1))
    v = json.load(open(f"{R}/validate.json")); print("validate:", v["metrics"], v["passed"])
except Exception as e:
    print("summary error:", type(e).__name__, e)
PY
pack
S0=$SECONDS
timeout 30 python3 -m mopt build -j 1 recipes/h200-compile.toml --json > $R/build2.json 2> $R/build2.err
echo "build2 rc=$? $((SECONDS-S0)) s" | tee -a $R/times.txt
echo "== warm start in a fresh process (t=$((SECONDS-START)) s, $(left) s left)"
if [ $(left) -gt 40 ]; then
  rm -rf /tmp/wc; mkdir -p /tmp/wc/ind /tmp/wc/tri
  TORCHINDUCTOR_CACHE_DIR=/tmp/wc/ind TRITON_CACHE_DIR=/tmp/wc/tri timeout $(left) python3 $D/warm.py $B/weights $B/torch-compile $R/warm.json > $R/warm.log 2>&1
  echo "warm rc=$?"; grep -v Warning $R/warm.log | head -45
fi
echo "== done (t=$((SECONDS-START)) s)"
} 2>&1 | tee $R/log.txt
pack
