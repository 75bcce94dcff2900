#!/usr/bin/env bash
# The GPU checks in one go, under 8 minutes on an H200 (docs/gpu.md):
#   1. pytest -m gpu: CUDA graph replay = eager and greedy = HF transformers on the
#      device (tests/test_cuda_graphs.py), the Triton kernels against the torch reference
#      (tests/test_triton_kernels.py, test_quant_triton.py, test_copy_blocks.py);
#   2. bench/gpu_kernels.py: paged decode attention and the dequantizing matmul;
#   3. bench/gpu_decode.py: decode steps with CUDA graphs on and off.
# Results go to $OUT when it is set (the device machine's return folder), else
# bench/results/gpu_check; each step's log beside them. Exit status: pytest's.
#
# The GPU machine of this workplace has torch, triton, transformers and pytest but not
# gguf or msgspec, and fetches nothing. Once, on the CPU host, in the repository that the
# session was started in (the one the device tool sends):
#   bash bench/gpu_check.sh --fetch-wheels      # writes .whl/ (ignored by git)
# then run it there with carry [".whl"]:  bash bench/gpu_check.sh
# The default model's GGUF (98 MB) is more than that machine is sent (64 MiB), so the
# real-GGUF test skips there; the tests' small random models need no file.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
  exec "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 msgspec==0.23.0
fi

RESULTS=${OUT:-bench/results/gpu_check}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
exec > >(tee "$LOG") 2>&1
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/aioengine-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/aioengine-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
# The CUDA path needs none of the C++ CPU kernels: skip their first build (a minute or
# more); a CPU step in the tests then runs the torch path.
export AIOENGINE_CPU_KERNELS=0
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
"$PY" - <<'EOF' || exit 1
import importlib.util
import sys

missing = [m for m in ("gguf", "msgspec", "torch", "triton", "transformers", "pytest")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing packages {missing}: run 'bash bench/gpu_check.sh --fetch-wheels' on "
             "the CPU host and carry .whl")
import torch, triton, transformers  # noqa: E401

print(f"torch {torch.__version__}, triton {triton.__version__}, transformers "
      f"{transformers.__version__}, CUDA available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device: nothing to check")
EOF

echo "== 1. pytest -m gpu"
workers=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 6" || echo "")
timeout 270 "$PY" -m pytest -q -m gpu -p no:cacheprovider $workers -o addopts="" \
  --durations=15 -rs tests/test_cuda_graphs.py tests/test_triton_kernels.py \
  tests/test_quant_triton.py tests/test_copy_blocks.py 2>&1 | tee "$RESULTS/pytest.log"
status=${PIPESTATUS[0]}

echo "== 2. bench/gpu_kernels.py"
timeout 40 "$PY" bench/gpu_kernels.py --batches 1,16,64 --contexts 512,4096 --out "$RESULTS"
timeout 40 "$PY" bench/gpu_kernels.py --quantized --formats Q4_1,Q8_0 --rows 1,16,64 \
  --weight-shapes 576x576,3072x576,576x1536,49152x576 --dtype bfloat16 --out "$RESULTS"

echo "== 3. bench/gpu_decode.py (CUDA graphs on / off)"
timeout 110 "$PY" bench/gpu_decode.py --batch-sizes 1,8,32,64 --steps 64 --out "$RESULTS"

date -u
echo "pytest exit status: $status"
exit "$status"
