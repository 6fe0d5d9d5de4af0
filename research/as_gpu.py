"""Run the tilegemm CLI as if the GPU had another name (not a test): what ``auto`` does on a GPU whose tables
tilegemm does not ship, or with another GPU's tables.

``torch.cuda.get_device_name`` is replaced before tilegemm is imported, so every table lookup (the survey tables,
the shipped tuned entries, the datasheet peaks the cost model reads) sees the given name. Times and ratios are
the real GPU's; the bench's JSON records the given name as its GPU.

    PYTHONPATH=src python3 research/as_gpu.py "NVIDIA H100 80GB HBM3" bench --sweep random --kernels auto
    PYTHONPATH=src python3 research/as_gpu.py "NVIDIA H200 (no table)" bench --sweep random --kernels auto
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    name = sys.argv[1]
    torch.cuda.get_device_name = lambda device=None: name
    from tilegemm.cli import main as cli_main

    return cli_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
