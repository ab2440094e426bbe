#!/usr/bin/env bash
# Issue 25's GPU benchmark in one command, on a machine with a CUDA GPU and torch (torchvision
# too, for the pipeline as users write it: without it a Pillow equivalent runs and each row says
# so). Made for the device tool's boxes (one H100/H200, 16 cores): a copy of the working tree,
# aioloader not installed, nothing fetched. About 3 minutes (see aioloader/_bench/gpu.py).
#
#   bash benchmarks/gpu_box.sh [OUT_DIR]     # default: $OUT/bench where $OUT is set, else ./gpu-bench
#
# OUT_DIR gets aioloader-bench.json (every row: per-epoch times, startup_s, server, server_why,
# PSS by process), aioloader-bench.log (the workload's output, ending with the issue's table in
# Markdown) and aioloader-bench.png. Exit status: aioloader bench's (1 when a row failed).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:+$OUT/bench}}
out=${out:-gpu-bench}
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
exit "$status"
