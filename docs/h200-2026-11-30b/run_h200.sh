#!/bin/bash
# Issue #6, run 1 on the H200 machine: SDPA/GEMM micro-benchmarks (probe.py), then the mopt
# chain of recipes/h200-compile.toml (weights -> torch-compile mode=max-autotune -> validate ->
# bench), a second no-op build, and a fresh-process warm start (warm.py). Everything lands in
# $OUT/log.txt and $OUT/results.tgz (re-packed after each step, so a timeout keeps what ran).
set -o pipefail
REPO=$PWD; D=$REPO/docs/h200-2026-11-30b; R=/tmp/res; mkdir -p $R
export PYTHONUNBUFFERED=1
START=$SECONDS
pack() { tar -C $R -czf $OUT/results.tgz . 2>/dev/null; }
left() { echo $(( 565 - (SECONDS - START) )); }
{
python3 -m pip install -q --force-reinstall --no-deps --no-index .wheels/check-helper/*.whl .wheels/mopt/*.whl 2>&1 | grep -v WARNING | tail -3
nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
echo "== probe (t=$((SECONDS-START)) s)"
timeout 100 python3 $D/probe.py $R/probe.json > $R/probe.log 2>&1; echo "probe rc=$?"; tail -4 $R/probe.log
BACKEND=$(grep -o '^BACKEND=[a-z]*' $R/probe.log | tail -1 | cut -d= -f2); BACKEND=${BACKEND:-auto}
echo "sdpa_backend for the build: $BACKEND"; pack
rm -rf /tmp/p; mkdir -p /tmp/p && cp -r recipes mopt.toml /tmp/p/ && cd /tmp/p
sed -i "s/^sdpa_backend = \"[a-z]*\"/sdpa_backend = \"$BACKEND\"/" recipes/h200-compile.toml
cp recipes/h200-compile.toml $R/recipe-as-built.toml
echo "== build1 (t=$((SECONDS-START)) s)"
S0=$SECONDS
timeout $(( $(left) - 20 )) python3 -m mopt build -j 1 -k recipes/h200-compile.toml --json > $R/build1.json 2> $R/build1.err
echo "build1 rc=$? $((SECONDS-S0)) s" | tee -a $R/times.txt; tail -6 $R/build1.err
S0=$SECONDS
timeout 30 python3 -m mopt build -j 1 recipes/h200-compile.toml --json > $R/build2.json 2> $R/build2.err
echo "build2 rc=$? $((SECONDS-S0)) s" | tee -a $R/times.txt
timeout 20 python3 -m mopt report recipes/h200-compile.toml --json > $R/report.json 2>&1
B=build/qwen3-shape/h200
cp $B/torch-compile/meta.json $R/meta.json; cp $B/validate/report.json $R/validate.json; cp $B/bench/bench.json $R/bench.json
ls -la $B/torch-compile/ > $R/artifact-ls.txt 2>&1
cp -r .mopt/logs $R/mopt-logs 2>/dev/null
head -c 2500 $R/meta.json; echo; pack
echo "== warm start in a fresh process (t=$((SECONDS-START)) s, $(left) s left)"
if [ $(left) -gt 45 ]; then
  timeout $(( $(left) - 5 )) python3 $D/warm.py $B/weights $B/torch-compile $R/warm.json > $R/warm.log 2>&1
  echo "warm rc=$?"; cat $R/warm.log | grep -v Warning | tail -60
fi
echo "== done (t=$((SECONDS-START)) s)"
} 2>&1 | tee $R/log.txt
cp $R/log.txt $OUT/log.txt; pack
