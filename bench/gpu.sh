#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, from the checkout's root on a machine with one:
#     bash bench/gpu.sh                       # logs under $OUT (default: gpu-results/)
# 1. build rlcore/cuda's kernels (the first CUDA use would; timed here): the log-prob kernels and
#    the decode-attention kernel; test them against their PyTorch twins and the fp64 definition
#    (tests/test_cuda_kernels.py);
# 2. bench/logprobs_cuda.py: the kernels against their twins, alone and inside token_logprobs;
# 3. bench/rollout.py on the GPU, rlcore against transformers' generate in the same process, with
#    the HBM roofline of the decoding steps: Qwen2.5-0.5B's shape, 64 x 512 new tokens, in bf16
#    autocast, fp32 and bf16 weights, then bf16 autocast again with the static step run eagerly
#    (RLCORE_CUDA_GRAPHS=0: what the CUDA graphs save), then the benchmark's model in fp32;
# 4. tests/test_gpu.py: the CUDA path against transformers on the same GPU, the fp64 definition
#    and the CPU tests' own criteria (learning, resume), graphed against eager decoding, the
#    attention kernel against its twin inside the engine, and the shipped GSM8K config on the GPU.
# Each step has a time limit in seconds (GPU_SH_LIMITS="build tests bench rollout gpu_tests"), and
# none runs past GPU_SH_DEADLINE seconds from the start, so a time-limited GPU session still brings
# back the logs of what ran.
# GPU_SH_SMOKE=1 makes it a smoke run (tests/test_bench_smoke.py, on a GPU): the kernels built, the
# two benchmarks at a tiny size (every line, no figure), the test files collected but not run.
# Needs torch with CUDA, nvcc, ninja, transformers, pytest, tokenizers, safetensors and jinja2; no
# install of rlcore (PYTHONPATH) and no network.
set -u -o pipefail
out=${OUT:-gpu-results}
mkdir -p "$out"
read -r t_build t_tests t_bench t_rollout t_gpu <<< "${GPU_SH_LIMITS:-300 180 90 90 600}"
deadline=${GPU_SH_DEADLINE:-3600}
SECONDS=0
limit() { local left=$((deadline - SECONDS)); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
logprobs_smoke="" rollout_smoke="" pytest_smoke=""
if [ "${GPU_SH_SMOKE:-0}" = 1 ]; then
    logprobs_smoke="--batch 1 --tokens 32 --hidden 32 --vocab 1024 --chunk-size 16 --repeats 1 --warmup 1"
    rollout_smoke="--shape tiny --prompts 1 --G 2 --prompt-len 4 --new-tokens 2 --peak-n 64 --copy-gib 0.001"
    pytest_smoke="--collect-only"
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $py -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
    nvcc --version | tail -2
} 2>&1 | tee "$out/machine.txt"

timeout "$(limit "$t_build")" $py -c "from rlcore import cuda; cuda.build('token_logprobs', verbose=True)" > "$out/build.log" 2>&1
echo "token_logprobs build exit status $? after $SECONDS s" | tee -a "$out/build.log"
started=$SECONDS
timeout "$(limit "$t_build")" $py -c "from rlcore import cuda; cuda.build('decode_attention', verbose=True)" >> "$out/build.log" 2>&1
echo "decode_attention build exit status $? after $((SECONDS - started)) s" | tee -a "$out/build.log"

timeout "$(limit "$t_tests")" $py -m pytest -q -p no:cacheprovider -rs -k "not compile" $pytest_smoke tests/test_cuda_kernels.py > "$out/test_cuda_kernels.log" 2>&1
echo "tests/test_cuda_kernels.py exit status $?" | tee -a "$out/test_cuda_kernels.log"
tail -3 "$out/test_cuda_kernels.log"

timeout "$(limit "$t_bench")" $py bench/logprobs_cuda.py $logprobs_smoke 2>&1 | tee "$out/logprobs_cuda.log"

qwen="--shape qwen2.5-0.5b --prompts 8 --G 8 --new-tokens 512"
for run in "1 $qwen --dtype bf16" "1 $qwen" "1 $qwen --dtype bf16-weights" "0 $qwen --dtype bf16" "1 "; do
    read -r graphs args <<< "$run"
    echo "== RLCORE_CUDA_GRAPHS=$graphs bench/rollout.py --device cuda $args" | tee -a "$out/rollout.log"
    RLCORE_CUDA_GRAPHS=$graphs timeout "$(limit "$t_rollout")" $py bench/rollout.py --device cuda $args $rollout_smoke 2>&1 \
        | grep -v Warning | tee -a "$out/rollout.log"
done

timeout "$(limit "$t_gpu")" $py -m pytest -q -p no:cacheprovider -rs -s $pytest_smoke tests/test_gpu.py > "$out/test_gpu.log" 2>&1
echo "tests/test_gpu.py exit status $?" | tee -a "$out/test_gpu.log"
grep -E "max \||shipped GSM8K|passed|failed|error|Error" "$out/test_gpu.log" | tail -30
