#!/usr/bin/env bash
# The CPU suite under the GPU machine's torch (2.11; CI installs 2.13): torch.compile, export and tracing differ
# between the two, and the GPU tests run on 2.11 only. On this machine, without a GPU:
#   bash tools/gpu_torch_check.sh                 # the compile, export and trace tests (about 8 minutes)
#   bash tools/gpu_torch_check.sh tests/nn -x     # any pytest arguments
# $TORCH_VERSION (default 2.11.0) and $VENV (default /tmp/tilegemm-torch-$TORCH_VERSION); PyPI's wheel of that
# torch is a CUDA build (about 5 GB with its libraries): it runs here on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
VENV=${VENV:-/tmp/tilegemm-torch-$TORCH_VERSION}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  grep -v '^torch' constraints.txt > "$VENV/constraints.txt"  # the interpreter's pins, not CI's torch
  "$VENV/bin/pip" install -q -c "$VENV/constraints.txt" "torch==$TORCH_VERSION" -e '.[test]'
fi
[ $# -gt 0 ] || set -- -k "compile or export or dynamo or traced" tests
TILEGEMM_INTERPRET=1 TRITON_INTERPRET=1 PYTHONPATH=src "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 "$@"
