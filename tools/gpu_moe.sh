#!/usr/bin/env bash
# One device call for MoE work: the MoE GPU tests on all GPUs, the MoE
# benchmark, then A/B runs of kernel variants (P2PCOMM_NVRTC_OPTIONS), each
# bounded. Needs the library in .devbuild/ (see tools/gpu_session.sh).
#   tools/gpu_moe.sh [tests] [bench] ["ab:P2PCOMM_NVRTC_OPTIONS=-DKNOB=V;OTHER=..."]...
# TEST_TAG names the test log (e.g. tests of a knob: P2PCOMM_NVRTC_OPTIONS=... TEST_TAG=-knob).
# Logs land under $OUT; short tables go to stdout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export P2PCOMM_TEST_GPU=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" P2PCOMM_LIB="$PWD/.devbuild/libp2pcomm.so"
export P2PCOMM_CACHE_DIR=/tmp/p2pcomm-cache P2PCOMM_TIMEOUT_MS=10000
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l); nab=0
run() { local t=$1; shift; timeout "$t" python3 -m torch.distributed.run --nproc_per_node="$N" "$@"; }
table() { grep -E "^\|" "$1" | grep -vE "^\|[-:| ]+\|$" | head -40; }
for step in "${@:-tests bench}"; do
    case "$step" in
    tests)
        run 300 -m pytest -q --maxfail=8 -p no:cacheprovider -rf tests/python/dist/test_moe.py \
            > "$OUT/moe-test${TEST_TAG:-}.txt" 2>&1
        echo "moe tests${TEST_TAG:-} nproc=$N rc=$?"
        grep -E "^(FAILED|ERROR)|^E  " "$OUT/moe-test${TEST_TAG:-}.txt" | sort | uniq -c | sort -rn | head -12
        grep -E "[0-9]+ (passed|failed)" "$OUT/moe-test${TEST_TAG:-}.txt" | sort | uniq -c
        ;;
    bench)
        run 240 -m p2pcomm.bench moe --out "$OUT/moe" > "$OUT/moe-bench.txt" 2>&1; echo "moe bench rc=$?"
        table "$OUT/moe/"*.md
        ;;
    ab:*)  # ab:VAR=value;VAR=value... (BENCH_EXTRA: more benchmark arguments)
        opts=${step#ab:}; tag=ab$((++nab))
        (
            IFS=';' read -ra kv <<< "$opts"
            for a in "${kv[@]}"; do export "$a"; done
            run 200 -m p2pcomm.bench moe --tokens 4096 --combine-dtype dtype ${BENCH_EXTRA:-} --out "$OUT/$tag" \
                > "$OUT/$tag.txt" 2>&1
            echo "A/B [$opts] rc=$?"
        )
        table "$OUT/$tag/"*.md | grep -v "nccl"
        ;;
    esac
done
