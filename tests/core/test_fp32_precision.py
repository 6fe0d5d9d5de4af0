"""fp32 products follow torch's fp32 matmul setting through either of its APIs."""
import textwrap

import pytest

from fresh_kit import run_fresh

SETTINGS = [
    ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", "tf32"),
    ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", "ieee"),
    ("torch.backends.fp32_precision = 'tf32'", "tf32"),
    ("torch.set_float32_matmul_precision('high')", "tf32"),
    ("pass", "ieee"),
]


def _script(setting: str) -> str:
    return textwrap.dedent(f"""
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
        """)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each setting's script in a fresh process of its own (the setting is the process's), run once for the tests."""
    return run_fresh({setting: _script(setting) for setting, _ in SETTINGS}, tmp_path_factory.mktemp("fp32"),
                     timeout=300)


@pytest.mark.parametrize("setting,expected", SETTINGS)
def test_resolve_precision_reads_either_api(runs, setting, expected):
    # torch.get_float32_matmul_precision() raises once the per-backend API was used: every fp32 product did too
    returncode, stdout, stderr = runs[setting]
    assert returncode == 0, stderr[-2000:]
    assert stdout.split() == [expected, "ieee", "True", "True"]
