#!/usr/bin/env bash
# Issue 25's GPU checks in one command, on a machine with a CUDA GPU and torch (torchvision
# too, for the pipeline as users write it: without it a Pillow equivalent runs and each row says
# so). Made for the device tool's boxes (one H100/H200, 16 cores): a copy of the working tree,
# aioloader not installed, nothing fetched. About 5 minutes (297 s on an H200, 2026-11-30):
#
#   1. `aioloader bench --only gpu` (about 4 minutes, see aioloader/_bench/gpu.py): the
#      ImageFolder pipeline through torch's DataLoader and aioloader's, the issue's table;
#   2. the CUDA tests (tests/device/test_device_cuda.py, about 30 s), where pytest-asyncio is
#      installed (the device boxes have none: carry its wheel); else a line says they did not run;
#   3. `benchmarks/gpu_check.py --quick --sections 1 3` (at most 90 s): the device stage's
#      correctness under a lagging consumer and its bandwidth, with what bounds it;
#   4. where TORCH_TEST_FILE names torch's test/test_dataloader.py (carried: the box fetches
#      nothing; expecttest's wheel too), `benchmarks/torch_tests.sh` on it: torch's own tests,
#      their CUDA ones included, on torch's DataLoader and on ours swapped in (2-3 minutes).
#
#   bash benchmarks/gpu_box.sh [OUT_DIR]     # default: $OUT/bench where $OUT is set, else ./gpu-bench
#
# OUT_DIR gets aioloader-bench.json (every row: per-epoch times, startup_s, server, server_why,
# PSS by process, CPU per batch, the loader's statistics), aioloader-bench.log (the workload's
# output, ending with the issue's table in Markdown), aioloader-bench.png, cuda-tests.log,
# gpu-check.log and torch-tests/ (step 4). Exit status: 1 when a step failed (a bench row, a
# test, a correctness check, a torch test that passes on torch's DataLoader and not on ours).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:+$OUT/bench}}
out=${out:-gpu-bench}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$python" - <<'PY'
import os, sys, torch
try:
    import torchvision
    tv = f"torchvision {torchvision.__version__}"
except Exception as exc:
    tv = f"no torchvision ({type(exc).__name__}: {exc})"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {tv}, {os.cpu_count()} cores,",
      f"CUDA: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
PY
status=0
"$python" -m aioloader bench --only gpu --out "$out" || status=$?
# The workload's own output (its lines and the issue's table) is in the log, not on stdout.
echo; echo "== the gpu workload's table ($out/aioloader-bench.log) =="
sed -n '/^| |/,$p' "$out/aioloader-bench.log" || true
echo; echo "== the CUDA tests ($out/cuda-tests.log) =="
if "$python" -c "import pytest_asyncio" 2>/dev/null; then
    "$python" -m pytest tests/device/test_device_cuda.py -q -p no:cacheprovider \
        >"$out/cuda-tests.log" 2>&1 || status=1
    tail -n 4 "$out/cuda-tests.log"
else
    echo "not run: pytest-asyncio is not installed here (carry its wheel, >= 1.5)" \
        | tee "$out/cuda-tests.log"
fi
echo; echo "== gpu_check.py --quick --sections 1 3 ($out/gpu-check.log) =="
"$python" benchmarks/gpu_check.py --quick --sections 1 3 --budget 90 >"$out/gpu-check.log" 2>&1 \
    || status=1
cat "$out/gpu-check.log"
if [ -n "${TORCH_TEST_FILE:-}" ]; then
    echo; echo "== torch's test_dataloader.py, torch's DataLoader and ours ($out/torch-tests) =="
    bash benchmarks/torch_tests.sh "$TORCH_TEST_FILE" "$out/torch-tests" || status=1
fi
exit "$status"
