#!/bin/sh
# vLLM server for qwen3-chat-0-6b on h200
# MODEL_DIR: the 'weights' artifact of target 'weights' (mopt show qwen3-chat-0-6b.h200:weights)
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL_DIR="${MODEL_DIR:?set MODEL_DIR to the model folder (see the comment above)}"
export VLLM_USE_FLASHINFER_SAMPLER=0
exec vllm serve "$MODEL_DIR" --config "$HERE/vllm.yaml" "$@"
