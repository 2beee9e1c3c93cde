#!/usr/bin/env bash
# World sizes larger than the GPUs at hand: N ranks share the GPUs
# (P2PCOMM_SHARE_GPUS=1) under MPS, so that their kernels run side by side
# and can wait for each other. For correctness; timings here are not NVLink's
# (the ranks share one GPU's memory and SMs).
# Uses $P2PCOMM_LIB, else build/libp2pcomm.so (`make lib`); needs
# nvidia-cuda-mps-control. `make gpu-test-shared NPROC=8` runs the GPU suite.
#   tools/gpu_shared.sh SECONDS NPROC PYTEST-ARGS...
#   tools/gpu_shared.sh SECONDS NPROC -m MODULE ARGS...  or  SCRIPT.py ARGS... (not test_*.py)
#   (e.g. -m p2pcomm.bench moe; NCCL refuses shared GPUs, so it has no NCCL baseline)
# Logs land under $OUT, default build/logs ($LOG.txt, default shared<NPROC>.txt; mps/).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export P2PCOMM_TEST_GPU=1 P2PCOMM_SHARE_GPUS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python"
export P2PCOMM_LIB=${P2PCOMM_LIB:-$PWD/build/libp2pcomm.so}
export P2PCOMM_TIMEOUT_MS=${P2PCOMM_TIMEOUT_MS:-20000}
OUT=${OUT:-$PWD/build/logs}; mkdir -p "$OUT/mps"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY="$OUT/mps"
t=$1 n=$2; shift 2
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY"
# A fresh daemon each run: after a client fails, MPS may refuse new ones.
echo quit | nvidia-cuda-mps-control > /dev/null 2>&1 && sleep 1
nvidia-cuda-mps-control -d || { echo "MPS did not start"; exit 3; }
trap 'echo quit | nvidia-cuda-mps-control > /dev/null 2>&1' EXIT
script=${1:-}; script=${script##*/}
if [[ "${1:-}" != -m && ( "$script" != *.py || "$script" == test_* ) ]]; then set -- -m pytest -q -p no:cacheprovider -rf "$@"; fi
timeout "$t" python3 -m torch.distributed.run --nproc_per_node="$n" "$@" > "$OUT/${LOG:-shared$n}.txt" 2>&1
rc=$?
echo "shared nproc=$n rc=$rc: $(grep -E '[0-9]+ (passed|failed|skipped)' "$OUT/${LOG:-shared$n}.txt" | sed 's/ in .*//' | sort | uniq -c | tr '\n' ' ')"
grep -E "^(FAILED|ERROR)|^E  " "$OUT/${LOG:-shared$n}.txt" | sort | uniq -c | sort -rn | head -12
exit $rc
