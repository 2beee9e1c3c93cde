#!/usr/bin/env bash
# One device-machine session: check the machine, run the GPU tests, tune and
# benchmark, and leave logs in $OUT. Needs the library built without MPI
# (`go build -buildmode=c-shared -o .devbuild/libp2pcomm.so ./golib/capi`)
# carried in .devbuild/. Usage: tools/gpu_session.sh [tests|bench|moe|all]...
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export P2PCOMM_TEST_GPU=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" P2PCOMM_LIB="$PWD/.devbuild/libp2pcomm.so"
export P2PCOMM_CACHE_DIR=/tmp/p2pcomm-cache P2PCOMM_TIMEOUT_MS=${P2PCOMM_TIMEOUT_MS:-10000}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/logs.txt"
what=" ${*:-all} "
NGPU=$(nvidia-smi -L | wc -l)
RUN="python3 -m torch.distributed.run"
summary=()
note() { summary+=("$*"); echo "== $*" | tee -a "$LOG"; }
want() { [[ "$what" == *" $1 "* || "$what" == *" all "* ]]; }

{ nvidia-smi -L; nvidia-smi topo -m; date -u; } >> "$LOG" 2>&1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' | tee -a "$LOG"

timeout 300 $RUN --nproc_per_node=2 tools/gpu_smoke.py > "$OUT/smoke.txt" 2>&1
note "smoke rc=$? $(grep SMOKE "$OUT/smoke.txt")"
grep -E "^BAD" "$OUT/smoke.txt" | head -20

if want tests; then
    for n in "$NGPU" 2; do
        timeout 420 $RUN --nproc_per_node="$n" -m pytest -q --maxfail=8 -p no:cacheprovider -rf tests/python/dist \
            > "$OUT/gpu-test-$n.txt" 2>&1
        rc=$?
        grep -E "^(FAILED|ERROR)|^E  " "$OUT/gpu-test-$n.txt" | sort | uniq -c | sort -rn | head -30
        note "gpu-test nproc=$n rc=$rc: $(grep -E '[0-9]+ (passed|failed)' "$OUT/gpu-test-$n.txt" | sort | uniq -c | head -3 | tr '\n' ' ')"
    done
fi
if want micro; then
    timeout 400 $RUN --nproc_per_node="$NGPU" tools/gpu_micro.py > "$OUT/micro.txt" 2>&1
    note "micro rc=$?"; sed -n '/^micro:/,$p' "$OUT/micro.txt"; grep -E "Error|error" "$OUT/micro.txt" | head -5
fi
if want moe; then
    timeout 300 $RUN --nproc_per_node="$NGPU" -m p2pcomm.bench moe --out "$OUT/bench$NGPU" >> "$LOG" 2>&1
    note "bench moe rc=$?"; tail -30 "$LOG"
fi
if want bench; then
    timeout 300 $RUN --nproc_per_node="$NGPU" -m p2pcomm.tune >> "$LOG" 2>&1
    note "tune rc=$?"
    timeout 400 $RUN --nproc_per_node="$NGPU" -m p2pcomm.bench --graph --out "$OUT/bench$NGPU" > "$OUT/bench.txt" 2>&1
    note "bench rc=$?"
    P2PCOMM_MAX_BLOCKS=64 timeout 200 $RUN --nproc_per_node="$NGPU" -m p2pcomm.bench --min-bytes $((4<<20)) \
        --algorithms twoshot --out /tmp/b64 >> "$LOG" 2>&1
    note "bench 64 blocks rc=$?"; grep -E "p2pcomm +twoshot" "$LOG" | tail -8
    sed -n '/summary/,$p' "$OUT/bench.txt"
fi
printf '%s\n' "${summary[@]}"
