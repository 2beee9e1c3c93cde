#!/usr/bin/env bash
# The last device call of a session, when device time is short: GPU tests on
# all GPUs, then the all-reduce and MoE benchmarks, logs under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export P2PCOMM_TEST_GPU=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" P2PCOMM_LIB="$PWD/.devbuild/libp2pcomm.so"
export P2PCOMM_CACHE_DIR=/tmp/p2pcomm-cache P2PCOMM_TIMEOUT_MS=10000
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l); RUN="python3 -m torch.distributed.run --nproc_per_node=$N"
timeout 150 $RUN -m pytest -q --maxfail=8 -p no:cacheprovider -rf tests/python/dist > "$OUT/test.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/test.txt" | sort | uniq -c | sort -rn | head -12
grep -E "[0-9]+ (passed|failed)" "$OUT/test.txt" | sort | uniq -c
timeout 150 $RUN -m p2pcomm.bench --graph --out "$OUT/ar" > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
timeout 120 $RUN -m p2pcomm.bench moe --out "$OUT/moe" > "$OUT/moe.txt" 2>&1; echo "moe rc=$?"
tail -25 "$OUT/moe.txt"
sed -n '/summary/,$p' "$OUT/bench.txt"
