#!/usr/bin/env bash
# One prepared GPU check for pycoll's CUDA paths (docs/cuda.md). Run from the repo root:
#
#     bash tools/gpu_check.sh            # logs also go to $OUT (the device tool) or ./gpu_check_out
#
# 1. environment: nvidia-smi, python, torch (must be a CUDA build), cupy, NCCL, pycoll doctor;
# 2. wheels carried in .whl/ (if any) go to /tmp/site, never a torch wheel when a CUDA torch is
#    already installed; if cupy cannot load libnccl, the nvidia-nccl wheel's lib folder is added
#    to LD_LIBRARY_PATH;
# 3. tests/ranks/test_cuda.py (CPU parts + every GPU test) under a 240 s limit;
# 4. the GPU bench (python -m pycoll cuda-bench): pycoll-nccl and torch-nccl (world 1 on one GPU),
#    pycoll-ipc and pycoll-staging (2 and 4 processes sharing the GPU), all_reduce 8 B..256 MiB,
#    under a 200 s limit; prints a table.
# Exit status: 0 only if the tests passed and the bench had no wrong element and no failed row.
# Budget: about 8 minutes on one H200 (setup < 1 min, tests <= 4, bench <= 3.5).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-./gpu_check_out}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
start=$(date +%s)
say() { echo "== [$(( $(date +%s) - start ))s] $*"; }

say "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY - <<'PYEOF'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda build", torch.version.cuda,
      "devices", torch.cuda.device_count())
sys.exit(0 if torch.version.cuda else 3)
PYEOF
cuda_torch=$?

if ls .whl/*.whl >/dev/null 2>&1; then
    say "installing carried wheels into /tmp/site"
    wheels=$(ls .whl/*.whl)
    if [ "$cuda_torch" = 0 ]; then wheels=$(ls .whl/*.whl | grep -v -E '/torch-[0-9]' || true); fi
    if [ -n "$wheels" ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
            && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
fi

nccl_probe() { $PY -c "from cupy.cuda import nccl; assert getattr(nccl, 'available', True); print('cupy', __import__('cupy').__version__, 'nccl', nccl.get_version())" 2>&1; }
if ! nccl_probe; then
    lib=$($PY -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
    if [ -n "$lib" ] && [ -d "$lib" ]; then
        export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        say "retrying cupy.cuda.nccl with LD_LIBRARY_PATH=$lib"
        nccl_probe || say "cupy.cuda.nccl unavailable: the nccl rows and tests will be skipped"
    fi
fi
$PY -m pycoll doctor 2>&1 | tee "$OUTDIR/doctor.txt"

say "tests/ranks/test_cuda.py"
timeout -k 10 240 $PY -m pytest -q -rs tests/ranks/test_cuda.py -p no:cacheprovider 2>&1 | tee "$OUTDIR/tests.log"
tests_rc=${PIPESTATUS[0]}
say "tests exit status $tests_rc"

say "bench (python -m pycoll cuda-bench)"
rm -f "$OUTDIR/bench.jsonl"
timeout -k 10 200 $PY -m pycoll cuda-bench --timeout 45 --json "$OUTDIR/bench.jsonl" 2>&1 | tee "$OUTDIR/bench.txt"
bench_rc=${PIPESTATUS[0]}
say "bench exit status $bench_rc"

say "done: tests $tests_rc, bench $bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
