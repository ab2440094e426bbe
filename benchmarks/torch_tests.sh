#!/usr/bin/env bash
# torch's own test/test_dataloader.py, run twice on this machine: as torch ships it, then with
# aioloader's DataLoader swapped in (benchmarks/torch_swap/aioloader_swap.py, a pytest plugin
# that changes the import before the file is imported), and the tests that pass on torch but
# not swapped, listed. The file is torch's, not ours: fetch the one of the installed torch's
# version (github.com/pytorch/pytorch, tag v<version>, test/test_dataloader.py) and pass its path.
# Its imports need expecttest and hypothesis; on a GPU box its CUDA tests run too (pinning,
# CUDA tensors from spawn/forkserver workers), which a CPU machine skips.
#
#   bash benchmarks/torch_tests.sh PATH/test_dataloader.py [OUT_DIR] [pytest options...]
#
# OUT_DIR (default: $OUT/torch-tests where $OUT is set, else ./torch-tests) gets torch.log and
# aioloader.log (pytest's output of each run). Default pytest options: -q -n 8 (pytest-xdist),
# a 120 s timeout per test (pytest-timeout). Exit status: 1 when a test that passes on torch
# fails or errors swapped.
set -uo pipefail
test_file=$(realpath "${1:?the path of torch test/test_dataloader.py}")
shift
out=${1:-${OUT:+$OUT/torch-tests}}
out=$(realpath -m "${out:-torch-tests}")
[ $# -gt 0 ] && shift
options=("$@")
[ ${#options[@]} -eq 0 ] && options=(-q -n 8 --timeout 120)
cd "$(dirname "$0")/.."
mkdir -p "$out"
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$test_file" "$work/test_dataloader.py"
# torch's file, not this project's: its own rootdir and no config of ours (-c /dev/null).
run() {
    (cd "$work" && PYTHONPATH="$OLDPWD:$OLDPWD/benchmarks/torch_swap${PYTHONPATH:+:$PYTHONPATH}" \
        "$python" -m pytest test_dataloader.py -c /dev/null -p no:cacheprovider "$@" \
        "${options[@]}")
}
echo "== torch's DataLoader"
run --junitxml "$work/torch.xml" >"$out/torch.log" 2>&1
tail -n 1 "$out/torch.log"
echo "== aioloader's DataLoader, the import swapped"
run -p aioloader_swap --junitxml "$work/aioloader.xml" >"$out/aioloader.log" 2>&1
tail -n 1 "$out/aioloader.log"
"$python" - "$work/torch.xml" "$work/aioloader.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    found = {}
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    return found


torch, ours = outcomes(sys.argv[1]), outcomes(sys.argv[2])
lost = sorted(n for n, o in torch.items() if o == "passed" and ours.get(n, "missing") != "passed")
print(f"passed on torch: {sum(o == 'passed' for o in torch.values())}; of those, swapped: "
      f"{sum(o == 'passed' for n, o in ours.items() if torch.get(n) == 'passed')}")
for name in lost:
    print(f"  not passed swapped ({ours.get(name, 'missing')}): {name}")
sys.exit(1 if lost else 0)
PY
