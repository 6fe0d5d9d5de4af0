"""Bench adapters for the guide's memory-bound kernels: ``copy`` and ``grey`` (GB/s)."""

from __future__ import annotations

import torch

from tilegemm.bench.base import BenchError, BenchOp, Case, Prepared


def _size_case(n: int) -> Case:
    # 4M, 16K or the count itself: a label of its own for every size, which --shape reads back
    label = f"{n >> 20}M" if n % 2**20 == 0 else f"{n >> 10}K" if n % 2**10 == 0 else str(n)
    return Case(label, dict(numel=n), float(n))


class CopyBench(BenchOp):
    name = "copy"
    metric = "GB/s"
    baseline_name = "torch copy"
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "uint8": torch.uint8}
    sweeps = {
        "sizes": lambda: [_size_case(2**p) for p in (22, 24, 26, 28)],
        "tiny": lambda: [_size_case(2**p) for p in (12, 14, 16)],
    }
    gpu_sweep, cpu_sweep = "sizes", "tiny"
    shape_help = "an element count (e.g. 67108864, or 64M, 16K: 2**20 and 2**10 elements)"

    def parse_shape(self, text):
        t = text.strip()
        unit = {"K": 2**10, "M": 2**20}.get(t[-1:].upper(), 1)
        try:
            n = int(t[:-1] if unit > 1 else t) * unit
        except ValueError:
            raise BenchError(f"malformed copy size {text!r}: expected {self.shape_help}") from None
        if n < 1:
            raise BenchError(f"malformed copy size {text!r}: must be >= 1")
        return _size_case(n)

    def prepare(self, case, dtype, device, n_sets, options):
        tdtype = self.dtypes[dtype]
        n = case.dims["numel"]
        sets = []
        for _ in range(n_sets):
            x = (torch.randint(0, 256, (n,), device=device, dtype=torch.uint8) if tdtype == torch.uint8
                 else torch.randn(n, device=device, dtype=tdtype))
            sets.append(dict(x=x))
        return Prepared(sets, sets[0]["x"].clone(), bytes_per_set=2 * n * tdtype.itemsize)

    def case_bytes(self, case, dtype, options):
        """x, the reference (a clone) and one output."""
        return 3 * case.dims["numel"] * self.dtypes[dtype].itemsize

    def run(self, kernel, inputs, dtype):
        from tilegemm import copy

        return copy(inputs["x"])

    def baseline(self, inputs, dtype):
        return inputs["x"].clone()

    def work(self, case, dtype, options):
        return 2.0 * case.dims["numel"] * self.dtypes[dtype].itemsize

    def tolerance(self, dtype):
        return 0.0



def _image_case(side: int) -> Case:
    return Case(f"3x{side}x{side}", dict(H=side, W=side), float(side))


class GreyBench(BenchOp):
    name = "grey"
    metric = "GB/s"
    baseline_name = "torch copy (same bytes)"
    baseline_computes_result = False
    dtypes = {"uint8": torch.uint8, "fp32": torch.float32, "fp16": torch.float16}
    sweeps = {
        "images": lambda: [_image_case(s) for s in (2048, 4096, 8192, 16384)],
        "tiny": lambda: [_image_case(s) for s in (64, 128, 256)],
    }
    gpu_sweep, cpu_sweep = "images", "tiny"
    shape_help = "H,W (e.g. 4096,4096)"

    def parse_shape(self, text):
        parts = text.replace("x", ",").split(",")
        try:
            h, w = (int(p) for p in parts)
        except ValueError:
            raise BenchError(f"malformed image size {text!r}: expected {self.shape_help}") from None
        if min(h, w) < 1:
            raise BenchError(f"malformed image size {text!r}: sizes must be >= 1")
        return Case(f"3x{h}x{w}", dict(H=h, W=w), float(h))

    def prepare(self, case, dtype, device, n_sets, options):
        tdtype = self.dtypes[dtype]
        H, W = case.dims["H"], case.dims["W"]
        sets = []
        for _ in range(n_sets):
            img = (torch.randint(0, 256, (3, H, W), device=device, dtype=torch.uint8) if tdtype == torch.uint8
                   else torch.rand(3, H, W, device=device, dtype=tdtype))
            # The baseline copies as many bytes as grey moves: 3 planes read + 1 written = 2 planes copied.
            sets.append(dict(img=img, same_bytes=torch.empty(2, H, W, device=device, dtype=tdtype)))
        first = sets[0]["img"].double()
        ref = 0.2989 * first[0] + 0.5870 * first[1] + 0.1140 * first[2]
        if tdtype == torch.uint8:
            ref = ref.round()
        return Prepared(sets, ref, bytes_per_set=4 * H * W * tdtype.itemsize)

    def case_bytes(self, case, dtype, options):
        """The image and the baseline's two planes, the image in float64 and the float64 reference (with one
        intermediate plane), one output."""
        return case.dims["H"] * case.dims["W"] * (6 * self.dtypes[dtype].itemsize + 5 * 8)

    def run(self, kernel, inputs, dtype):
        from tilegemm import rgb_to_grey

        return rgb_to_grey(inputs["img"])

    def baseline(self, inputs, dtype):
        return inputs["same_bytes"].clone()

    def work(self, case, dtype, options):
        return 4.0 * case.dims["H"] * case.dims["W"] * self.dtypes[dtype].itemsize

    def tolerance(self, dtype):
        # uint8: fp32 math rounds a few exact .5 ties the other way than the float64 reference (off by one)
        return {"uint8": 1e-3, "fp32": 1e-6, "fp16": 2e-3}[dtype]

