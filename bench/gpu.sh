#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, from the checkout's root on a machine with one:
#     bash bench/gpu.sh                       # logs under $OUT (default: gpu-results/)
# 1. tests/test_gpu.py: the CUDA path against transformers on the same GPU, the fp64 definition
#    and the CPU tests' own criteria (learning, resume), and the shipped GSM8K config on the GPU;
# 2. bench/rollout.py on the GPU, rlcore against transformers' generate in the same process: the
#    benchmark's model, then Qwen2.5-0.5B's shape at two batch sizes.
# Needs torch with CUDA, transformers, pytest, tokenizers, safetensors and jinja2; no install of
# rlcore (PYTHONPATH) and no network.
set -u -o pipefail
out=${OUT:-gpu-results}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $py -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
} 2>&1 | tee "$out/machine.txt"
$py -m pytest -q -p no:cacheprovider -rs -s tests/test_gpu.py > "$out/test_gpu.log" 2>&1
echo "tests/test_gpu.py exit status $?" | tee -a "$out/test_gpu.log"
grep -E "max \||shipped GSM8K|passed|failed|error|Error" "$out/test_gpu.log" | tail -30
for args in "" "--shape qwen2.5-0.5b" "--shape qwen2.5-0.5b --prompts 32 --new-tokens 256"; do
    echo "== bench/rollout.py --device cuda $args" | tee -a "$out/rollout.log"
    $py bench/rollout.py --device cuda $args 2>&1 | grep -v Warning | tee -a "$out/rollout.log"
done
