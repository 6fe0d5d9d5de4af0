"""The bench adapter of conv2d: ResNet-50 and MobileNetV2 layers, every convolution of torchvision's classification
models (``zoo``, or a part of it, ``zoo:I/N``: :mod:`tilegemm.ops.conv2d.zoo`), layers of odd channel counts
(``odd``), cuDNN (benchmark mode) as the baseline, work in
FLOPs. Options: ``mode``, ``fwd`` (the forward) or ``bwd`` (data and weight gradients); ``memory_format``,
``channels_last`` (the default, tilegemm's fast path) or ``nchw``: the layout of x, the weight and the output
gradient on both sides.

In ``bwd`` mode both sides compute grad x and grad weight from one output gradient and return them concatenated
(flattened) so that one tensor is checked: the concatenation is in both timings.
"""

from __future__ import annotations

import re

import torch

from tilegemm.bench.base import BenchError, BenchOp, Case, Prepared


# --mode: the forward, both gradients, or one of them ((data, weight) gradients computed).
_GRADS = {"bwd": (True, True), "dgrad": (True, False), "wgrad": (False, True)}
_MODES = ("fwd",) + tuple(_GRADS)


def _case(N, C, H, W, K, R, S, stride=1, pad=0, groups=1, x=0.0, show_pad=False) -> Case:
    # (a --shape's label names its padding: two shapes that differ in it alone must not share one)
    label = f"n{N}c{C}h{H}w{W}k{K}r{R}s{S}/{stride}" + (f"p{pad}" if show_pad else "") + (f"g{groups}" if groups > 1
                                                                                          else "")
    dims = dict(N=N, C=C, H=H, W=W, K=K, R=R, S=S, stride=stride, pad=pad, groups=groups)
    return Case(label, dims, float(x))


def _zoo_cases(sweep: str) -> list[Case]:
    """The ``zoo`` sweep or its part ``zoo:I/N``, ``zoo:KIND``, ``zoo:KIND:I/N`` (:mod:`tilegemm.ops.conv2d.zoo`):
    batch 32, each case's ``models`` naming the torchvision models the layer comes from."""
    from tilegemm.ops.conv2d import zoo

    try:
        part, parts, kind = zoo.parse_part(sweep)
    except ValueError as err:
        raise BenchError(str(err)) from None
    cases = []
    for i, layer in enumerate(zoo.part_layers(part, parts, kind)):
        (sh, sw), (ph, pw), (dh, dw) = layer["stride"], layer["padding"], layer["dilation"]
        C, K, H, W, R, S, groups = (layer[k] for k in ("C", "K", "H", "W", "R", "S", "groups"))
        label = (f"n{zoo.BATCH}c{C}h{H}w{W}k{K}r{R}s{S}/{sh}x{sw}p{ph}x{pw}" + (f"d{dh}x{dw}" if (dh, dw) != (1, 1)
                 else "") + (f"g{groups}" if groups > 1 else ""))
        dims = dict(N=zoo.BATCH, C=C, H=H, W=W, K=K, R=R, S=S, stride=sh, pad=ph, groups=groups, stride_w=sw,
                    pad_w=pw, dilation=dh, dilation_w=dw, models=",".join(layer["models"]))
        cases.append(Case(label, dims, float(i)))
    return cases


def _pairs(d) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(stride, padding, dilation) of a case as (h, w) pairs (the zoo's cases may differ along h and w)."""
    return ((d["stride"], d.get("stride_w", d["stride"])), (d["pad"], d.get("pad_w", d["pad"])),
            (d.get("dilation", 1), d.get("dilation_w", d.get("dilation", 1))))


def _out_size(d) -> tuple[int, int]:
    """(P, Q) of a case."""
    (sh, sw), (ph, pw), (dh, dw) = _pairs(d)
    return ((d["H"] + 2 * ph - dh * (d["R"] - 1) - 1) // sh + 1, (d["W"] + 2 * pw - dw * (d["S"] - 1) - 1) // sw + 1)


def _distinct(layers, N) -> list[Case]:
    seen, cases = set(), []
    for layer in layers:
        if layer not in seen:
            seen.add(layer)
            C, H, K, R, stride, groups = layer
            cases.append(_case(N, C, H, H, K, R, R, stride, R // 2, groups, x=len(cases)))
    return cases


def resnet50_layers() -> list[tuple]:
    """(C, H, K, R, stride, groups) of every convolution of torchvision's ResNet-50 at 224x224, in order."""
    layers = [(3, 224, 64, 7, 2, 1)]
    c, h = 64, 56
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            s = stride if b == 0 else 1
            layers += [(c, h, width, 1, 1, 1), (width, h, width, 3, s, 1)]
            h_out = h // s
            layers.append((width, h_out, 4 * width, 1, 1, 1))
            if b == 0:
                layers.append((c, h, 4 * width, 1, s, 1))  # the downsample shortcut
            c, h = 4 * width, h_out
    return layers


def mobilenet_v2_layers() -> list[tuple]:
    """(C, H, K, R, stride, groups) of MobileNetV2's depthwise and pointwise convolutions at 224x224."""
    layers, c, h = [], 32, 112
    for t, out, n, stride in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                              (6, 160, 3, 2), (6, 320, 1, 1)):
        for i in range(n):
            s = stride if i == 0 else 1
            hidden = c * t
            if t != 1:
                layers.append((c, h, hidden, 1, 1, 1))  # expand
            layers.append((hidden, h, hidden, 3, s, hidden))  # depthwise
            h //= s
            layers.append((hidden, h, out, 1, 1, 1))  # project
            c = out
    layers.append((c, h, 1280, 1, 1, 1))
    return layers


def odd_channel_cases() -> list[Case]:
    """Layers whose channels a group are not multiples of 16, batch 32 (the padded route,
    :mod:`tilegemm.ops.conv2d.padded`): odd counts (copied), multiples of 8 (read in place: EfficientNetV2's and
    GoogLeNet's 24-channel 3x3s, RegNetY-1.6GF's groups of 24), and a 1x1 that stays on its GEMM."""
    layers = [  # (C, H, K, R, stride, groups)
        (57, 56, 113, 3, 1, 1), (35, 56, 67, 3, 2, 1), (100, 28, 100, 3, 1, 1), (100, 28, 200, 1, 1, 1),
        (24, 28, 40, 5, 1, 1), (24, 112, 24, 3, 1, 1), (24, 14, 64, 3, 1, 1), (120, 28, 120, 3, 1, 5),
        (48, 112, 48, 3, 2, 2),
    ]
    return [_case(32, C, H, H, K, R, R, stride, R // 2, groups, x=i)
            for i, (C, H, K, R, stride, groups) in enumerate(layers)]


class Conv2dBench(BenchOp):
    name = "conv2d"
    metric = "TFLOPS"
    baseline_name = "cuDNN"
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}
    sweeps = {
        "resnet50": lambda: _distinct(resnet50_layers(), 32),
        "mobilenet": lambda: _distinct(mobilenet_v2_layers(), 64),
        "tiny": lambda: [_case(2, 8, 9, 9, 16, 3, 3, 1, 1, x=0), _case(2, 16, 6, 6, 16, 1, 1, x=1),
                         _case(2, 8, 8, 8, 8, 3, 3, 2, 1, groups=8, x=2)],
        "zoo": lambda: _zoo_cases("zoo"),  # zoo:I/N (part I of N), zoo:KIND, zoo:KIND:I/N too (cases())
        "odd": lambda: odd_channel_cases(),
    }
    gpu_sweep = "resnet50"
    cpu_sweep = "tiny"
    options = ("mode", "memory_format")
    shape_help = "N,C,H,W,K,R,S[,stride[,pad[,groups]]] (e.g. 32,64,56,56,64,3,3,1,1)"
    models = {"resnet50": "tilegemm.models.bench:ResNet50Bench"}  # images/s of a converted ResNet-50 vs cuDNN

    def model_bench(self, name: str, **kwargs):
        """``resnet50``'s entry, or any other torchvision classification model's
        (:class:`tilegemm.models.bench.TorchvisionBench`: ``--model resnext50_32x4d``, ...)."""
        if name in self.models:
            return super().model_bench(name, **kwargs)
        from tilegemm.models.bench import TorchvisionBench
        from tilegemm.models.torchvision_models import names

        if name not in names():
            raise BenchError(f"op conv2d has no model {name!r}; choose resnet50 or a torchvision classification "
                             f"model: {', '.join(names())}")
        return TorchvisionBench(name, **kwargs)

    def cases(self, sweep: str) -> list[Case]:
        if sweep.startswith("zoo:"):
            return _zoo_cases(sweep)
        return super().cases(sweep)

    @staticmethod
    def _mode(options) -> str:
        mode = options.get("mode") or "fwd"
        if mode not in _MODES:
            raise BenchError(f"--mode must be one of {', '.join(_MODES)}, got {mode!r}")
        return mode

    @staticmethod
    def _format(options) -> torch.memory_format:
        name = options.get("memory_format") or "channels_last"
        if name not in ("channels_last", "nchw"):
            raise BenchError(f"--memory-format must be channels_last or nchw, got {name!r}")
        return torch.channels_last if name == "channels_last" else torch.contiguous_format

    def check_options(self, options, dtype):
        super().check_options(options, dtype)
        self._mode(options)
        self._format(options)

    def parse_shape(self, text: str) -> Case:
        parts = re.split(r"[,x\s]+", text.strip())
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise BenchError(f"malformed conv2d shape {text!r}: expected {self.shape_help}") from None
        if not 7 <= len(values) <= 10:
            raise BenchError(f"malformed conv2d shape {text!r}: expected {self.shape_help}")
        N, C, H, W, K, R, S = values[:7]
        stride, pad, groups = (values[7:] + [1, 0, 1][len(values) - 7:])[:3]
        if min(N, C, H, W, K, R, S, stride, groups) < 1 or pad < 0 or C % groups or K % groups:
            raise BenchError(f"malformed conv2d shape {text!r}: sizes must be >= 1 and C, K divisible by groups")
        if H + 2 * pad < R or W + 2 * pad < S:
            raise BenchError(f"malformed conv2d shape {text!r}: the filter is larger than the padded input")
        return _case(N, C, H, W, K, R, S, stride, pad, groups, show_pad=True)

    @staticmethod
    def _conv(d) -> dict:
        stride, padding, dilation = _pairs(d)
        return dict(stride=stride, padding=padding, dilation=dilation, groups=d["groups"])

    def _precision(self, dtype: str) -> str:
        return "tf32" if dtype == "tf32" else "ieee"

    def prepare(self, case, dtype, device, n_sets, options):
        from tilegemm.ops.conv2d.reference import conv2d_reference

        d = case.dims
        mode = self._mode(options)
        tdtype = self.dtypes[dtype]
        conv = self._conv(d)
        fan_in = d["C"] // d["groups"] * d["R"] * d["S"]
        P, Q = _out_size(d)
        sets = self._sets(case, dtype, device, n_sets, options)
        first = sets[0]
        x64, w64 = first["x"].double(), first["w"].double()
        if mode == "fwd":
            reference = conv2d_reference(x64, w64, None, **conv)
        else:
            dx, dw, _ = torch.ops.aten.convolution_backward(
                first["dy"].double(), x64, w64, None, list(conv["stride"]), list(conv["padding"]),
                list(conv["dilation"]), False, [0, 0], conv["groups"], list(_GRADS[mode]) + [False])
            reference = self._flat_grads(dx, dw)
        size = tdtype.itemsize
        x_bytes, w_bytes, y_bytes = (d["N"] * d["C"] * d["H"] * d["W"], d["K"] * fan_in, d["N"] * d["K"] * P * Q)
        nbytes = (x_bytes + w_bytes + y_bytes) * size * (1 if mode == "fwd" else 2)
        return Prepared(sets, reference, bytes_per_set=nbytes)

    def case_bytes(self, case, dtype, options):
        """x, w (and dy), their float64 copies, the float64 reference (the gradients also concatenated), one
        kernel's output."""
        d = case.dims
        P, Q = _out_size(d)
        x, w, y = d["N"] * d["C"] * d["H"] * d["W"], d["K"] * d["C"] // d["groups"] * d["R"] * d["S"], \
            d["N"] * d["K"] * P * Q
        size = self.dtypes[dtype].itemsize
        if self._mode(options) == "fwd":
            return (x + w) * (size + 8) + y * (8 + size)
        return (x + w + y) * (size + 8) + (x + w) * (8 + 8 + size)

    def precompile_inputs(self, case, dtype, device, options):
        """Without the float64 reference (a float64 convolution per layer, of no use to a compile)."""
        return self._sets(case, dtype, device, 1, options)[0]

    def _sets(self, case, dtype, device, n_sets, options) -> list[dict]:
        from tilegemm.ops.conv2d.checks import check_conv

        d = case.dims
        mode = self._mode(options)
        fmt = self._format(options)
        tdtype = self.dtypes[dtype]
        conv = self._conv(d)
        fan_in = d["C"] // d["groups"] * d["R"] * d["S"]
        P, Q = _out_size(d)
        sets = []
        for _ in range(n_sets):
            x = torch.randn(d["N"], d["C"], d["H"], d["W"], device=device, dtype=tdtype)
            w = torch.randn(d["K"], d["C"] // d["groups"], d["R"], d["S"], device=device, dtype=tdtype) / fan_in**0.5
            inputs = dict(x=x.contiguous(memory_format=fmt), w=w.to(tdtype).contiguous(memory_format=fmt), conv=conv,
                          mode=mode, channels_last=fmt == torch.channels_last)
            if mode != "fwd":
                dy = torch.randn(d["N"], d["K"], P, Q, device=device, dtype=tdtype)
                inputs["dy"] = dy.contiguous(memory_format=fmt)
                # The gradients' arguments as autograd's backward passes them (the forward checked the call):
                # checking them again on every timed call would bill tilegemm for host work a backward pass
                # does not do.
                g = check_conv(inputs["x"], inputs["w"], None, conv["stride"], conv["padding"], conv["dilation"],
                               conv["groups"])
                inputs["grad_args"] = dict(stride=list(g.stride), padding=list(g.padding), dilation=list(g.dilation),
                                           groups=g.groups, precision=self._precision(dtype))
            sets.append(inputs)
        return sets

    @staticmethod
    def _flat_grads(dx, dw):
        # channels-last order on both sides, whatever layout each returned; a gradient not asked for is None
        return torch.cat([t.permute(0, 2, 3, 1).flatten() for t in (dx, dw) if t is not None])

    def run(self, kernel, inputs, dtype):
        from tilegemm.ops.conv2d import conv2d
        from tilegemm.ops.conv2d.op import backward_data, backward_weight
        from tilegemm.ops.conv2d.problem import DgradCall, WgradCall

        x, w, conv = inputs["x"], inputs["w"], inputs["conv"]
        precision = self._precision(dtype)
        if inputs["mode"] == "fwd":
            return conv2d(x, w, None, **conv, kernel=kernel, precision=precision)
        if kernel != "auto":
            from tilegemm.core.registry import NotApplicable

            raise NotApplicable("the backward picks its kernels by geometry: bench it as kernel auto")
        grad = inputs["grad_args"]
        want_dx, want_dw = _GRADS[inputs["mode"]]
        dx = backward_data(DgradCall(dy=inputs["dy"], weight=w, x_shape=list(x.shape),
                                     x_channels_last=inputs["channels_last"], **grad)) if want_dx else None
        dw = backward_weight(WgradCall(dy=inputs["dy"], x=x, w_shape=list(w.shape), **grad)) if want_dw else None
        return self._flat_grads(dx, dw)

    def baseline(self, inputs, dtype):
        x, w, conv = inputs["x"], inputs["w"], inputs["conv"]
        if inputs["mode"] == "fwd":
            return torch.nn.functional.conv2d(x, w, None, **conv)
        s, p, dil = list(conv["stride"]), list(conv["padding"]), list(conv["dilation"])
        dx, dw, _ = torch.ops.aten.convolution_backward(inputs["dy"], x, w, None, s, p, dil, False, [0, 0],
                                                        conv["groups"], list(_GRADS[inputs["mode"]]) + [False])
        return self._flat_grads(dx, dw)

    def baseline_context(self, dtype):
        return _CudnnMode(dtype)

    def work(self, case, dtype, options):
        d = case.dims
        P, Q = _out_size(d)
        flops = 2.0 * d["N"] * P * Q * d["K"] * (d["C"] // d["groups"]) * d["R"] * d["S"]
        return flops * (2 if self._mode(options) == "bwd" else 1)  # dgrad and wgrad: the forward's FLOPs each

    def tolerance(self, dtype):
        from tilegemm.ops.conv2d.reference import tolerance

        return tolerance(self.dtypes[dtype], self._precision(dtype))


class _CudnnMode:
    """cuDNN in benchmark mode (it times its algorithms per shape first), tf32 only for the ``tf32`` dtype.
    ``None`` (tilegemm's own rows) changes nothing."""

    def __init__(self, dtype: str | None):
        self.dtype = dtype

    def __enter__(self):
        cudnn = torch.backends.cudnn
        self.old = cudnn.benchmark, cudnn.allow_tf32
        if self.dtype is not None:
            cudnn.benchmark = True
            cudnn.allow_tf32 = self.dtype == "tf32"

    def __exit__(self, *exc):
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = self.old
