#!/usr/bin/env bash
# The GPU check, for the day a session is lent a device (run it once, record the numbers):
#
#     bash benchmarks/gpu_check.sh [out_dir]          # about 6 minutes on one H200
#
# 1. the CUDA tests (streams, pinned memory, swap from pinned copies, FSDP2 through Trainer),
#    which skip everywhere else;
# 2. the 1B preset (a 1.2B-parameter Llama from a config, bf16, 4096 tokens): remat against native
#    (every layer, every 2nd, offload), the per-policy table (none, selective, recompute, offload),
#    the block-swap sweep;
# 3. the planner's Pareto run against native's every_n_layers options on the same preset;
# 4. the head (benchmarks/head.py): a 128k vocabulary, 2 x 4096 tokens, plain against chunked and TRL's fused head.
#
# Everything lands in out_dir (default benchmarks/out): JSON, PNGs, and a log per part; the
# tables for RESULTS.md are in the logs. Without a GPU it runs the policy table and the Pareto
# run on the CPU at the tiny preset (the suite runs it that way), so the script itself is tested
# wherever it lives.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/out}"
mkdir -p "$out"
python="${PYTHON:-python}"
tests_failed=0

if "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    device=cuda preset=1b dtype=bfloat16 repeats=5 every_n=(1 2 3 4) sections=(compare policies swap)
    head=(--vocab 131072 --hidden 1024 --seq 4096 --chunks 4096 1024 256)
    # a failing test is recorded, and the benchmarks still run (device time is scarce)
    "$python" -m pytest -q -k "cuda" tests/ 2>&1 | tee "$out/gpu-check-tests.log" || tests_failed=1
else
    echo "gpu_check: no CUDA device, running the CPU fallback (tiny preset, one repeat)"
    device=cpu preset=tiny dtype=float32 repeats=1 every_n=(1) sections=(policies)
    head=(--vocab 4096 --hidden 64 --seq 64 --chunks 32)
fi

common=(--preset "$preset" --device "$device" --dtype "$dtype" --out "$out")
# each script prints its tables on stdout (progress bars go to stderr)
"$python" benchmarks/run.py "${common[@]}" --repeats "$repeats" --policy-repeats "$repeats" \
    --swap-repeats "$repeats" --sections "${sections[@]}" --no-peak | tee "$out/gpu-check-run.log"
"$python" benchmarks/pareto.py "${common[@]}" --repeats "$repeats" --plan-repeats "$repeats" \
    --every-n "${every_n[@]}" | tee "$out/gpu-check-pareto.log"
"$python" benchmarks/head.py --device "$device" --dtype "$dtype" --repeats "$repeats" "${head[@]}" \
    | tee "$out/gpu-check-head.log"
echo "gpu_check: done ($device, preset $preset); results in $out"
if [ "$tests_failed" -ne 0 ]; then
    echo "gpu_check: some CUDA tests failed: see $out/gpu-check-tests.log"
    exit 1
fi
