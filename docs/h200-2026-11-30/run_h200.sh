#!/bin/bash
# mopt build of recipes/h200-compile.toml on the H200 machine: twice (the second must not recompile)
set -o pipefail
REPO=$PWD
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-index .wheels/check-helper/*.whl .wheels/mopt/*.whl 2>&1 | tail -3
mkdir -p /tmp/p && cp -r recipes mopt.toml /tmp/p/ && cd /tmp/p
which python3; python3 -c "import torch; print(torch.__version__)"; nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | tee $OUT/gpu.txt
SECONDS=0
python3 -m mopt build recipes/h200-compile.toml --json > $OUT/build1.json 2> >(tee $OUT/build1.err >&2)
echo "build1 rc=$? ${SECONDS} s" | tee -a $OUT/times.txt
SECONDS=0
python3 -m mopt build recipes/h200-compile.toml --json > $OUT/build2.json 2> $OUT/build2.err
echo "build2 rc=$? ${SECONDS} s" | tee -a $OUT/times.txt
python3 -m mopt show recipes/h200-compile.toml 'qwen3-shape.h200:torch-compile' --json > $OUT/show.json 2>&1
cp build/qwen3-shape/h200/torch-compile/meta.json $OUT/meta.json 2>/dev/null
tail -5 $OUT/build2.err; cat $OUT/times.txt; head -c 1500 $OUT/meta.json
echo; echo "== warm start in a fresh process"
python3 $REPO/.wheels/warm.py build/qwen3-shape/h200/weights build/qwen3-shape/h200/torch-compile $OUT/warm.json 2>&1 | tail -12
