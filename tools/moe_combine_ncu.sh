#!/usr/bin/env bash
# Profiles rank 0's third moe_combine_send (see tools/moe_combine_ncu.py) with
# Nsight Compute on a device machine; the report goes to $OUT/combine_send.txt.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/python" P2PCOMM_LIB="${P2PCOMM_LIB:-$PWD/.devbuild/libp2pcomm.so}"
export P2PCOMM_CACHE_DIR=/tmp/p2pcomm-cache P2PCOMM_TIMEOUT_MS=300000 P2PCOMM_MOE_BARRIER_KERNELS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
cat > /tmp/ncu_rank0.sh <<'INNER'
#!/usr/bin/env bash
if [ "${LOCAL_RANK:-0}" = 0 ]; then
    exec ncu --clock-control none -k regex:moe_combine_send --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
        --section WarpStateStats --section Occupancy --print-details all python3 "$@"
fi
exec python3 "$@"
INNER
chmod +x /tmp/ncu_rank0.sh
timeout 400 python3 -m torch.distributed.run --nproc_per_node="$N" --no-python /tmp/ncu_rank0.sh \
    tools/moe_combine_ncu.py > "$OUT/combine_send.txt" 2>&1
echo "ncu rc=$?"
grep -iE "Duration|Throughput|Busy|stall|Warp Cycles|Issued|Eligible|Active Warps|No Eligible|Registers|L1/TEX Hit|L2 Hit|Mem Pipes|done" \
    "$OUT/combine_send.txt" | head -90
