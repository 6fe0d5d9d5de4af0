"""fp32 products follow torch's fp32 matmul setting through either of its APIs."""
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize("setting,expected", [
    ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", "tf32"),
    ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", "ieee"),
    ("torch.backends.fp32_precision = 'tf32'", "tf32"),
    ("torch.set_float32_matmul_precision('high')", "tf32"),
    ("pass", "ieee"),
])
def test_resolve_precision_reads_either_api(setting, expected):
    # torch.get_float32_matmul_precision() raises once the per-backend API was used: every fp32 product did too
    code = f"""
        import torch
        {setting}
        import tilegemm
        from tilegemm.core.dtypes import resolve_precision
        print(resolve_precision(None, torch.float32), resolve_precision(None, torch.float16))
        a, b = torch.randn(9, 16), torch.randn(2, 16, 8)
        offs = torch.tensor([4, 9], dtype=torch.int32)
        ref = torch.cat([a[:4].double() @ b[0].double(), a[4:].double() @ b[1].double()])
        out = tilegemm.grouped_mm(a, b, offs=offs)
        x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
        conv = tilegemm.conv2d(x, w)
        conv_ref = torch.nn.functional.conv2d(x.double(), w.double())
        print(float((out.double() - ref).abs().max()) < 1e-4, float((conv.double() - conv_ref).abs().max()) < 1e-4)
        """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [expected, "ieee", "True", "True"]
