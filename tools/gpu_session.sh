#!/usr/bin/env bash
# One device-machine session: check the machine, run the GPU tests, tune and
# benchmark, and leave logs in $OUT. Needs the library built without MPI
# (`make lib MPI=0 LIB=.devbuild/libp2pcomm.so`) carried in .devbuild/.
# Usage: tools/gpu_session.sh [tests|bench|all]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export P2PCOMM_TEST_GPU=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" P2PCOMM_LIB="$PWD/.devbuild/libp2pcomm.so"
export P2PCOMM_CACHE_DIR=/tmp/p2pcomm-cache P2PCOMM_TIMEOUT_MS=${P2PCOMM_TIMEOUT_MS:-10000}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-all}
NGPU=$(nvidia-smi -L | wc -l)
summary=()
note() { summary+=("$*"); echo "== $*"; }

nvidia-smi -L | tee "$OUT/machine.txt"
nvidia-smi topo -m >> "$OUT/machine.txt" 2>&1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' | tee -a "$OUT/machine.txt"

# Smoke: load the library, compile every kernel once (fills the cache).
timeout 300 python3 -m torch.distributed.run --nproc_per_node=2 tools/gpu_smoke.py 2>&1 | tee "$OUT/smoke.log" | tail -25
note "smoke rc=${PIPESTATUS[0]}"

if [ "$what" = tests ] || [ "$what" = all ]; then
    for n in "$NGPU" 2; do
        timeout 420 python3 -m torch.distributed.run --nproc_per_node="$n" -m pytest -q --maxfail=6 -p no:cacheprovider \
            tests/python/dist 2>&1 | tee "$OUT/gpu-test-$n.log" | grep -E "passed|failed|Error|error" | tail -8
        note "gpu-test nproc=$n rc=${PIPESTATUS[0]}: $(grep -E '[0-9]+ (passed|failed)' "$OUT/gpu-test-$n.log" | tail -1)"
    done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout 300 python3 -m torch.distributed.run --nproc_per_node="$NGPU" -m p2pcomm.tune 2>&1 | tee "$OUT/tune.log" | tail -20
    timeout 400 python3 -m torch.distributed.run --nproc_per_node="$NGPU" -m p2pcomm.bench --graph --out "$OUT/bench$NGPU" \
        2>&1 | tee "$OUT/bench-$NGPU.log" | tail -40
    note "bench nproc=$NGPU rc=${PIPESTATUS[0]}"
fi
printf '%s\n' "${summary[@]}"
