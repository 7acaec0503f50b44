#!/bin/bash
# mopt build of recipes/h200-compile.toml (weights → torch-compile → validate → bench) on the H200
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-index .wheels/check-helper/*.whl .wheels/mopt/*.whl 2>&1 | grep -v WARNING | tail -3
rm -rf /tmp/p; mkdir -p /tmp/p && cp -r recipes mopt.toml /tmp/p/ && cd /tmp/p
SECONDS=0
python3 -m mopt build recipes/h200-compile.toml --json > $OUT/build1.json 2> >(tee $OUT/build1.err >&2)
echo "build1 rc=$? ${SECONDS} s" | tee -a $OUT/times.txt
SECONDS=0
python3 -m mopt build recipes/h200-compile.toml --json > $OUT/build2.json 2> $OUT/build2.err
echo "build2 rc=$? ${SECONDS} s" | tee -a $OUT/times.txt
python3 -m mopt report recipes/h200-compile.toml --json > $OUT/report.json 2>&1
cp build/qwen3-shape/h200/validate/report.json $OUT/validate.json 2>/dev/null
cp build/qwen3-shape/h200/bench/bench.json $OUT/bench.json 2>/dev/null
cat $OUT/report.json | head -60
