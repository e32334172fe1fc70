#!/usr/bin/env bash
# Everything in the repository that needs a CUDA GPU, in one run (CI has no GPU; see docs/benchmarks.md):
#   1. the Triton kernels compiled on the GPU against their PyTorch references (tests/test_kernels.py, dev=cuda),
#      the engine on CUDA (tests/test_cuda.py: Triton backend vs reference, half-precision logprobs, the memory
#      budget against the device) and the NCCL group of tensor parallelism (tests/test_tensor_parallel.py -k nccl);
#   2. benchmarks/bench_kernels.py: decode bandwidth and prefill TFLOP/s of the kernels.
# Usage, from the repository root on a GPU machine with torch, triton and transformers installed:
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # default runs/gpu; a junit XML, logs and kernels.json land there
set -u
OUT_DIR=${1:-runs/gpu}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  echo "gpu_check: $PY cannot import torch; name a Python that has torch, triton and transformers: PYTHON=/path/to/python bash $0" >&2
  exit 2
fi
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PY's torch sees no CUDA device (torch.cuda.is_available() is False): run this on a GPU machine;" \
       "without one the GPU tests skip in the normal suite (make test)" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT_DIR/gpu.txt"
$PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name(0))" | tee -a "$OUT_DIR/gpu.txt"
echo "== device memory outside PyTorch in a fresh process (CUDA context; after a first matmul, cuBLAS too)"
$PY - <<'PY' | tee -a "$OUT_DIR/gpu.txt"
import torch
def outside(what):
    free, total = torch.cuda.mem_get_info()
    print(f"{what}: device used {(total - free) / 2**20:,.0f} MiB, outside PyTorch {(total - free - torch.cuda.memory_reserved()) / 2**20:,.0f} MiB")
x = torch.zeros(1, device="cuda"); outside("after the first tensor")
a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16); (a @ a).sum().item(); outside("after a bf16 matmul")
PY
rc=0
echo "== tests on the GPU"
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -o addopts="" -p no:cacheprovider -q -rs -s --junitxml="$OUT_DIR/tests.xml" \
  ${TESTS:-tests/test_kernels.py tests/test_cuda.py tests/test_tensor_parallel.py} -k "cuda or nccl" 2>&1 | tee "$OUT_DIR/tests.log" | grep -v "^\s*$" | tail -40
rc=$(( rc | ${PIPESTATUS[0]} ))
[ -n "${SKIP_BENCH:-}" ] && { echo "gpu_check: exit $rc (tests only)"; exit $rc; }
echo "== kernel benchmark"
timeout "${BENCH_TIMEOUT:-240}" $PY benchmarks/bench_kernels.py ${BENCH_ARGS:-} --out "$OUT_DIR/kernels.json" > "$OUT_DIR/kernels.md" 2> "$OUT_DIR/kernels.err"
brc=$?
if [ $brc -eq 124 ]; then  # the full grid did not fit: the quick one
  echo "(the full grid timed out; --quick)"
  timeout 90 $PY benchmarks/bench_kernels.py --quick --out "$OUT_DIR/kernels.json" > "$OUT_DIR/kernels.md" 2> "$OUT_DIR/kernels.err"
  brc=$?
fi
cat "$OUT_DIR/kernels.md"; tail -5 "$OUT_DIR/kernels.err"
rc=$(( rc | brc ))
echo "gpu_check: exit $rc (tests and benchmark; 124 = a timeout)"
exit $rc
