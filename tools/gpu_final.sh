#!/usr/bin/env bash
# The last device calls of a session, when device time is short. Needs the
# library built without MPI in .devbuild/ (see tools/gpu_session.sh).
#   tools/gpu_final.sh tests   GPU tests on all GPUs and on 2, MoE benchmark (TEST_SECONDS bounds
#                              the first suite: on a fresh 2 x H100 machine it took ~380 s, the
#                              kernels' NVRTC compiles included, so keep the call's limit in mind)
#   tools/gpu_final.sh bench [N...]   tune + all-reduce benchmark (eager and graph) on N GPUs
#                                     (default: all, then 2)
# Logs and tables land under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export P2PCOMM_TEST_GPU=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" P2PCOMM_LIB="$PWD/.devbuild/libp2pcomm.so"
export P2PCOMM_CACHE_DIR=/tmp/p2pcomm-cache P2PCOMM_TIMEOUT_MS=10000
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
# run SECONDS NPROC ARGS...: torchrun on the first NPROC GPUs, bounded.
run() { local t=$1 n=$2; shift 2; CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout "$t" python3 -m torch.distributed.run --nproc_per_node="$n" "$@"; }
case "${1:-tests}" in
tests)
    run "${TEST_SECONDS:-360}" "$N" -m pytest -q --maxfail=8 -p no:cacheprovider -rf tests/python/dist > "$OUT/test$N.txt" 2>&1
    echo "tests nproc=$N rc=$?"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/test$N.txt" | sort | uniq -c | sort -rn | head -12
    grep -E "[0-9]+ (passed|failed)" "$OUT/test$N.txt" | sort | uniq -c
    if [ "$N" -gt 2 ]; then  # on two GPUs the run above was it
        run 150 2 -m pytest -q --maxfail=8 -p no:cacheprovider -rf tests/python/dist --ignore=tests/python/dist/test_gpu_matrix.py \
            > "$OUT/test2.txt" 2>&1
        echo "tests nproc=2 rc=$?"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/test2.txt" | sort | uniq -c | sort -rn | head -12
        grep -E "[0-9]+ (passed|failed)" "$OUT/test2.txt" | sort | uniq -c
    fi
    run 150 "$N" -m p2pcomm.bench moe --out "$OUT/moe" > "$OUT/moe.txt" 2>&1; echo "moe rc=$?"
    tail -30 "$OUT/moe.txt"
    ;;
bench)
    shift
    for n in ${@:-$N 2}; do
        export P2PCOMM_TUNE_FILE=/tmp/tune$n.json
        run 120 "$n" -m p2pcomm.tune > "$OUT/tune$n.txt" 2>&1; echo "tune nproc=$n rc=$?"; cp /tmp/tune$n.json "$OUT/" 2>/dev/null
        run 200 "$n" -m p2pcomm.bench --graph --reps 9 --rep-ms 30 --algorithms auto,oneshot_ll,twoshot_ll,oneshot,twoshot \
            --out "$OUT/ar$n" > "$OUT/bench$n.txt" 2>&1
        echo "bench nproc=$n rc=$?"; sed -n '/summary/,$p' "$OUT/bench$n.txt"
    done
    ;;
esac
