"""The bench's model entries: Llama decoding on tilegemm's 4-bit Linears (``--op w4a16 --model llama``) and
ResNet-50 inference on tilegemm's convolutions (``--op conv2d --model resnet50``).

Each is a :class:`~tilegemm.bench.base.ModelBench` that the op's adapter names in its ``models``; the runner
checks and times it like any op, one row for the baseline model and one (``auto``) for tilegemm's.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os

import torch

from tilegemm.bench.base import BenchError, Case, ModelBench, Prepared
from tilegemm.core.checks import relative_error
from tilegemm.core.runtime import interpreting
from tilegemm.models import llama, resnet

MODES = {
    "eager": "eager PyTorch",
    "graph": "the step replayed from a CUDA graph",
    "compile": "torch.compile (fixed shapes), the step replayed from a CUDA graph",
}


@contextlib.contextmanager
def _seeded(device: str):
    """torch's generators seeded with 0 inside and restored after: the same random model on every run, the
    caller's random state untouched."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        torch.manual_seed(0)
        yield


def _nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _require_transformers_model(model: str, title: str, tiny: bool) -> None:
    """BenchError where a transformers model entry cannot run here: transformers missing, or the full-size model
    (``title``'s shapes) asked for under the interpreter."""
    try:
        llama.require_transformers()
    except ImportError as err:
        raise BenchError(str(err)) from None
    if not tiny and interpreting():
        raise BenchError(f"--model {model} at {title}'s shapes needs a CUDA GPU; under the interpreter run --sweep tiny")


class LlamaDecodeBench(ModelBench):
    """Greedy decoding of a Llama-architecture model whose Linears, all but lm_head, are 4-bit
    (``tilegemm.nn.quantize_``), against the same model in fp16 with those int4 weights dequantized into it: the
    fp16 model then computes exactly what the int4 one should, at fp16's speed, so its logits are both the
    baseline's result and the reference.

    Timed: one decode step (one token per sequence) at the prompt's length, its last-position logits [B, V]
    the result. The step writes the same KV slot on every call (``Decoder(repeat=True)``), so it can be
    repeated as often as the timing wants.
    """

    name = "w4a16:llama"
    model = "llama"
    arch, title, full_config = "llama", "Llama", "llama3-8b"  # llama.ARCHS's key; the descriptions' words
    metric = "tokens/s"
    baseline_name = "fp16 (dequantized int4)"
    cpu_baseline_name = "fp16 (dequantized int4), CPU"
    dtypes = {"fp16": torch.float16}
    gpu_sweep, cpu_sweep = "decode", "tiny"
    gpu_modes = ("graph", "compile", "eager")
    shape_help = "BATCH[,MODE] (MODE: graph, compile or eager on a GPU; eager under the interpreter)"

    GPU_PROMPT, TINY_PROMPT = 512, 8

    def __init__(self, layers: int | None = None, checkpoint: str | None = None):
        """``layers``: Llama-3-8B decoder layers on the GPU; default as many of its 32 as fit
        (:func:`~tilegemm.models.llama.layers_that_fit`), decided when the cases are made. ``checkpoint``: a
        4-bit GPTQ/AWQ/compressed-tensors checkpoint directory to load (:func:`tilegemm.models.from_pretrained`)
        instead of building and quantizing a random model; every sweep then runs it."""
        super().__init__()
        self.layers = layers
        self._fitted = layers is None  # the layer count is what fits, not what was asked for
        self.checkpoint = None
        if checkpoint is not None:
            from tilegemm.models import pretrained

            try:  # refuse a directory that cannot load before any case runs
                config = pretrained.read_config(checkpoint)
                self._quant = pretrained.quant_config(config)
                pretrained._Tensors(os.fspath(checkpoint), torch.device("cpu"))  # (its files found as the load finds them)
                import transformers

                transformers.AutoConfig.from_pretrained(os.fspath(checkpoint))  # (a model type it knows)
            except ImportError as err:
                raise BenchError(f"--checkpoint needs transformers and safetensors: {err}") from None
            except (OSError, TypeError, ValueError, KeyError) as err:
                raise BenchError(f"--checkpoint: {err}") from None
            self.checkpoint, self._ckpt_config = os.fspath(checkpoint), config
        self.sweeps = {"decode": self._decode_cases, "tiny": self._tiny_cases}
        self._built = None  # (key, fp16 model, int4 model): kept across cases
        self._fused = None  # (key, the int4 model's copy with its projections joined): row fused, made on first use

    # Row ``fused`` (named with --kernels): the int4 model with q/k/v and gate/up joined (fuse_projections_).
    FUSED = "fused"

    def check_kernel(self, name):
        if name != self.FUSED:
            super().check_kernel(name)

    # --- cases

    def _require(self, tiny: bool) -> None:
        _require_transformers_model(self.model, llama.arch_of(self.arch)[3], tiny)

    def _case(self, batch: int, mode: str, tiny: bool, x: float) -> Case:
        if self.checkpoint is not None:
            layers, prompt = self._ckpt_config.get("num_hidden_layers"), self.TINY_PROMPT if tiny else self.GPU_PROMPT
            dims = dict(batch=batch, prompt=prompt, layers=layers, mode=mode, config="checkpoint")
            return Case(f"b{batch} {mode}", dims, float(x))
        if tiny:
            layers, prompt, config = llama.TINY_LAYERS, self.TINY_PROMPT, "tiny"
        else:
            self.layers = llama.layers_that_fit(self.layers, self.arch)
            layers, prompt, config = self.layers, self.GPU_PROMPT, self.full_config
        dims = dict(batch=batch, prompt=prompt, layers=layers, mode=mode, config=config)
        return Case(f"b{batch} {mode}", dims, float(x))

    def _decode_cases(self) -> list[Case]:
        self._require(tiny=False)
        points = [(batch, mode) for batch in (1, 16) for mode in ("graph", "compile")]
        return [self._case(batch, mode, False, i) for i, (batch, mode) in enumerate(points)]

    def _tiny_cases(self) -> list[Case]:
        self._require(tiny=True)
        return [self._case(batch, "eager", True, i) for i, batch in enumerate((1, 2))]

    def description(self, cases):
        d = cases[0].dims
        modes = "; ".join(f"{m} = {MODES[m]}" for m in dict.fromkeys(c.dims["mode"] for c in cases))
        if d["config"] == "checkpoint":
            c = self._ckpt_config
            name = os.path.basename(os.path.normpath(self.checkpoint))
            arch = ", ".join(c.get("architectures") or [str(c.get("model_type", "?"))])
            return (f"the checkpoint {name} ({arch}: hidden "
                    f"{c.get('hidden_size')}, intermediate {c.get('intermediate_size')}, heads "
                    f"{c.get('num_attention_heads')}/{c.get('num_key_value_heads')} KV, vocab {c.get('vocab_size')}, "
                    f"{d['layers']} layers; {self._quant.describe()}), loaded by tilegemm.models.from_pretrained; "
                    f"baseline and reference: the same model in fp16 with the int4 weights dequantized. Timed: one "
                    f"greedy decode step at position {d['prompt']}, after the {d['prompt']}-token prompt; {modes}")
        tiny = d["config"] == "tiny"
        _, full_shapes, full_layers, full_name = llama.arch_of(self.arch)
        shapes, full = (llama.TINY, llama.TINY_LAYERS) if tiny else (full_shapes, full_layers)
        layers = f"{d['layers']} layers" + ("" if tiny or d["layers"] == full else
                                            f" (of {full}{': what fits' if self._fitted else ''})")
        return (f"{'a tiny ' + self.title if tiny else full_name + ' shapes'} (hidden {shapes['hidden_size']}, intermediate "
                f"{shapes['intermediate_size']}, heads {shapes['num_attention_heads']}/"
                f"{shapes['num_key_value_heads']} KV, vocab {shapes['vocab_size']}), {layers}, random fp16 weights; "
                f"int4: tilegemm.nn.quantize_ g{self._group(tiny)}, every Linear but lm_head; baseline and reference: "
                f"the same model in fp16 with the int4 weights dequantized. Timed: one greedy decode step at "
                f"position {d['prompt']}, after the {d['prompt']}-token prompt; {modes}. Row fused (--kernels "
                f"auto,fused): the int4 model after tilegemm.nn.absorb_act_order_ and fuse_projections_ (q/k/v and gate/up "
                f"joined)")

    @staticmethod
    def _group(tiny: bool) -> int:
        return llama.TINY_GROUP if tiny else llama.LLAMA3_8B_GROUP

    # --- models and inputs

    def _models(self, dims: dict, device: str):
        """(fp16 model, int4 model), built on the first case and kept: building Llama-3-8B takes seconds and
        half the GPU's memory."""
        key = (dims["config"], dims["layers"], device)
        if self._built is None or self._built[0] != key:
            self._built = self._fused = None
            self.release()
            if dims["config"] == "checkpoint":
                from tilegemm.models.pretrained import dequantized_copy, from_pretrained

                try:
                    int4 = from_pretrained(self.checkpoint, device=device)
                except (ValueError, TypeError, OSError) as err:  # (a damaged or incomplete checkpoint: one line)
                    raise BenchError(f"--checkpoint: {err}") from None
                self._built = (key, dequantized_copy(int4), int4)
                return self._built[1:]
            tiny = dims["config"] == "tiny"
            with _seeded(device):
                fp16 = llama.build(tiny=tiny, layers=dims["layers"], device=device, arch=self.arch)
            int4 = llama.quantized_copy(fp16, self._group(tiny))
            llama.dequantized_copy_into(fp16, int4)
            self._built = (key, fp16, int4)
        return self._built[1:]

    def prepare(self, case, dtype, device, n_sets, options):
        self.release()  # the previous case's decoders: static caches, graphs, compiled steps
        d = case.dims
        fp16, int4 = self._models(d, device)
        batch, prompt_len, mode = d["batch"], d["prompt"], d["mode"]
        prompt = torch.randint(0, fp16.config.vocab_size, (batch, prompt_len),
                               generator=torch.Generator().manual_seed(0)).to(device)
        self._compiled = self._compiled or mode == "compile"
        decoders = {}
        for name, model in (("fp16", fp16), ("int4", int4)):
            dec = llama.Decoder(model, batch, prompt_len + 1, device, graph=mode == "graph",
                                compiled=mode == "compile", repeat=True)
            dec.prefill(prompt)
            decoders[name] = dec
        for dec in decoders.values():
            # every row steps on the baseline's next token: its own argmax may differ on a near-tie (bf16), and
            # the logits after two different tokens are not comparable
            dec.ids.copy_(decoders["fp16"].ids)
            if dec.graph:
                dec.capture()

        def fused_step():
            from tilegemm.nn import absorb_act_order_, fuse_projections_

            key = self._built[0]
            if self._fused is None or self._fused[0] != key:
                self._fused = (key, fuse_projections_(absorb_act_order_(copy.deepcopy(int4))))
            dec = llama.Decoder(self._fused[1], batch, prompt_len + 1, device, graph=mode == "graph",
                                compiled=mode == "compile", repeat=True)
            dec.prefill(prompt)
            dec.ids.copy_(decoders["fp16"].ids)
            if dec.graph:
                dec.capture()
            decoders["fused decoder"] = dec  # (released with the others)
            return dec.next_logits

        decoders["fused"] = _lazy(fused_step, precise=False)
        reference = decoders["fp16"].next_logits().float()
        return Prepared([decoders], reference, bytes_per_set=_nbytes(int4))

    def run(self, kernel, inputs, dtype):
        if kernel == self.FUSED:
            return inputs["fused"]()
        return inputs["int4"].next_logits()

    def baseline(self, inputs, dtype):
        return inputs["fp16"].next_logits()

    def tolerance(self, dtype):
        # The int4 kernels and cuBLAS sum the same products in other orders, and the layers pass fp16 activations
        # on: 6.5e-3 over 32 layers of Llama-3-8B shapes on an H100. The tiny model (2 layers, the interpreter):
        # 6.3e-4 at batch 1, 5.8e-4 at batch 2; its bound leaves the same margin (~3x) as the GPU's.
        return 2e-2 if not interpreting() else 2e-3



class Qwen2DecodeBench(LlamaDecodeBench):
    """:class:`LlamaDecodeBench` on a second architecture: Qwen2-7B's shapes built from ``transformers.Qwen2Config``
    (biases on q, k and v, whose 4-bit Linears then add them in their epilogues; a 152k vocabulary)."""

    name = "w4a16:qwen2"
    model = "qwen2"
    arch, title, full_config = "qwen2", "Qwen2", "qwen2-7b"

def _lazy(make, precise: bool = True):
    """A function that calls what ``make()`` returns, made on the first call (a row that is not run builds
    nothing: no model copy, no graph, no compile); ``precise``: made under ``_Precise(benchmark=True)``, as the
    convolution models' rows are."""
    made = []

    def call():
        if not made:
            with _Precise(benchmark=True) if precise else contextlib.nullcontext():
                made.append(make())
        return made[0]()

    return call


def _forward(model, x: torch.Tensor, mode: str):
    """A function computing ``model(x)`` in ``mode`` (:attr:`ResNet50Bench.MODES`). ``graph``: three eager
    warm-up runs on a side stream, then one CUDA graph captured and replayed (x is its static input);
    ``compile-graph``: warmed up and recorded here, then each call starts a new step of torch's CUDA graph
    trees (the last output may be overwritten)."""
    if mode == "eager":
        return lambda: model(x)
    if mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = model(x)

        def replay():
            graph.replay()
            return out

        return replay
    if mode == "compile":
        fn = torch.compile(model, dynamic=False)
        return lambda: fn(x)
    fn = torch.compile(model, dynamic=False, mode="reduce-overhead")

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        return fn(x)

    with torch.no_grad():
        for _ in range(2):  # the trees' warm-up and recording: the bench's check then sees a replay
            step()
    return step


class _Precise:
    """cuDNN in benchmark mode (it times its algorithms per shape first), when asked, and fp32 as IEEE fp32: no
    tf32 in cuDNN, cuBLAS or tilegemm's fp32 kernels (they follow ``torch.get_float32_matmul_precision``)."""

    def __init__(self, benchmark: bool):
        self.benchmark = benchmark

    def __enter__(self):
        cudnn = torch.backends.cudnn
        self.old = cudnn.benchmark, cudnn.allow_tf32, torch.get_float32_matmul_precision()
        cudnn.benchmark = self.benchmark or cudnn.benchmark
        cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")

    def __exit__(self, *exc):
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, precision = self.old
        torch.set_float32_matmul_precision(precision)


class ResNet50Bench(ModelBench):
    """Inference of torchvision's ResNet-50 (random weights, fixed seed, eval mode), channels-last, its
    convolutions and fc on tilegemm's kernels (``tilegemm.nn.convert_``) against the same model on cuDNN;
    both eager or both under ``torch.compile``. Timed: one forward of the batch, its logits the result.

    The reference is the same model, with the same (rounded) weights, in fp32 with tf32 off for fp16 (in fp64
    for fp32), computed once per case. Under the interpreter the tiny sweep runs a two-block ResNet instead
    (no torchvision needed).
    """

    name = "conv2d:resnet50"
    model = "resnet50"
    metric = "images/s"
    baseline_name = "cuDNN"
    cpu_baseline_name = "torch (CPU)"
    dtypes = {"fp16": torch.float16, "fp32": torch.float32}
    gpu_sweep, cpu_sweep = "inference", "tiny"
    gpu_modes = ("eager", "graph", "compile", "compile-graph")
    shape_help = ("BATCH[,MODE] (MODE: eager, graph, compile or compile-graph on a GPU; eager under the "
                  "interpreter)")
    MODES = {
        "eager": "both eager",
        "graph": "both eager, the forward replayed from one CUDA graph",
        "compile": "both under torch.compile (fixed shapes)",
        "compile-graph": 'both under torch.compile(mode="reduce-overhead") (fixed shapes, CUDA graph trees)',
    }

    GPU_IMAGE, TINY_IMAGE = 224, 16  # tiny: a forward under the interpreter in seconds (as the zoo entry's)
    # Row ``fold`` (named with --kernels): the model converted with fold_batchnorm=True, each batch norm (and
    # the activation after it) applied by the convolution before it in eval mode.
    FOLD = "fold"

    def __init__(self, batches: tuple[int, ...] = (32, 256)):
        """``batches``: the batch sizes of the GPU sweep."""
        super().__init__()
        self.batches = tuple(batches)
        self.sweeps = {"inference": self._inference_cases, "tiny": self._tiny_cases}
        self._built = None  # (key, model on the baseline's kernels, on tilegemm's, the reference's)

    def default_dtype(self):
        return "fp32" if interpreting() else "fp16"  # fp16 convolutions on the CPU are slow and no one's use

    def check_kernel(self, name):
        if name != self.FOLD:
            super().check_kernel(name)

    # --- cases

    def _require(self, tiny: bool) -> None:
        if tiny:
            return
        if not resnet.has_torchvision():
            raise BenchError(f"--model resnet50 needs torchvision: {resnet.INSTALL} (the tiny sweep runs without it)")
        if interpreting():
            raise BenchError("--model resnet50 at 224x224 needs a CUDA GPU; under the interpreter run --sweep tiny")

    def _case(self, batch: int, mode: str, tiny: bool, x: float) -> Case:
        dims = dict(batch=batch, image=self.TINY_IMAGE if tiny else self.GPU_IMAGE, mode=mode,
                    config="tiny" if tiny else "resnet50")
        return Case(f"b{batch} {mode}", dims, float(x))

    def _inference_cases(self) -> list[Case]:
        self._require(tiny=False)
        points = [(batch, mode) for batch in self.batches for mode in self.gpu_modes]
        return [self._case(batch, mode, False, i) for i, (batch, mode) in enumerate(points)]

    def _tiny_cases(self) -> list[Case]:
        return [self._case(2, "eager", True, 0)]

    def description(self, cases):
        d = cases[0].dims
        what = ("a two-block ResNet (ResNet-50's stem and one bottleneck, toy widths)" if d["config"] == "tiny"
                else "torchvision's ResNet-50")
        modes = "; ".join(f"{m} = {self.MODES[m]}" for m in dict.fromkeys(c.dims["mode"] for c in cases))
        baseline = "torch's CPU convolutions" if interpreting() else "cuDNN (benchmark mode)"
        return (f"{what}, random weights (seed 0), eval mode, {d['image']}x{d['image']} channels-last images; "
                f"tilegemm.nn.convert_ (every convolution and the fc on tilegemm's kernels) against the same model "
                f"on {baseline}. Reference: the same model in fp32, tf32 off (fp64 for an fp32 run). Timed: one "
                f"forward of the batch; {modes}. Row fold (--kernels auto,fold): convert_(fold_batchnorm=True)")

    # --- models and inputs

    def _models(self, dims: dict, dtype: str, device: str):
        """(baseline model, tilegemm's, the reference's), built on the first case and kept."""
        key = (dims["config"], dtype, device)
        if self._built is None or self._built[0] != key:
            import tilegemm.nn

            self._built = None
            self.release()
            with _seeded("cpu"):
                base = self._build(dims["config"] == "tiny").eval()
            base = self._settle(base.to(device=device, memory_format=torch.channels_last), dims)
            ref = base.to(dtype=self.dtypes[dtype])
            ours = tilegemm.nn.convert_(copy.deepcopy(ref))
            exact = copy.deepcopy(ref).to(torch.float32 if dtype == "fp16" else torch.float64)
            self._built = (key, ref, ours, exact)
        return self._built[1:4]  # (a folded copy, made on first use, may follow)

    def _build(self, tiny: bool) -> torch.nn.Module:
        """The model in fp32 on the CPU (seeded by the caller)."""
        return resnet.make_model(tiny)

    def _settle(self, model: torch.nn.Module, dims: dict) -> torch.nn.Module:
        """The fp32 model on the device before it is cast and converted (ResNet-50 as built)."""
        return model

    def prepare(self, case, dtype, device, n_sets, options):
        self.release()  # the previous case's compiled models
        d = case.dims
        ref, ours, exact = self._models(d, dtype, device)
        x = torch.randn(d["batch"], 3, d["image"], d["image"], generator=torch.Generator().manual_seed(0))
        x = x.to(device=device, dtype=self.dtypes[dtype]).contiguous(memory_format=torch.channels_last)
        with torch.no_grad(), _Precise(benchmark=False):
            reference = exact(x.to(next(exact.parameters()).dtype))
        mode = d["mode"]
        self._compiled = self._compiled or mode.startswith("compile")
        with _Precise(benchmark=True):  # cuDNN picks its algorithms in the warm-up runs a graph replays
            inputs = dict(ours=_forward(ours, x, mode), ref=_forward(ref, x, mode),
                          fold=_lazy(lambda: _forward(self._folded(ours), x, mode)))
        return Prepared([inputs], reference, bytes_per_set=x.numel() * x.element_size() + _nbytes(ref))

    def _folded(self, ours: torch.nn.Module) -> torch.nn.Module:
        """A copy of tilegemm's model with its batch norms folded (row ``fold``), made on first use and kept with
        the models."""
        import tilegemm.nn

        if len(self._built) == 4:
            self._built += (tilegemm.nn.fold_batchnorm_(copy.deepcopy(ours)),)
        return self._built[4]

    def run(self, kernel, inputs, dtype):
        with torch.no_grad():
            return inputs["fold" if kernel == self.FOLD else "ours"]()

    def baseline(self, inputs, dtype):
        with torch.no_grad():
            return inputs["ref"]()

    def baseline_context(self, dtype):
        # The same for tilegemm's rows (dtype None): its model keeps torch's batch norms, pooling and adds.
        return _Precise(benchmark=True)

    def tolerance(self, dtype):
        # fp16: each of the 53 convolutions rounds its output to fp16 and the residual adds carry the errors on.
        # Against the fp32 model: tilegemm's 9.6e-4 (the interpreter, 32x32, batch 1), torch's CPU convolutions
        # 3.6e-4 to 8.7e-4 (224x224 batch 4, 32x32); the bound leaves cuDNN's algorithm choices ~20x. fp32
        # against fp64: 6e-8 (the tiny model), 4e-7 (torch's, 224x224); matmul's fp32 bound.
        return {"fp16": 2e-2, "fp32": 1e-4}[dtype]


def _train_deterministic(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in training mode (batch norms on the batch's statistics) but with its dropout and stochastic
    depth off, so that two copies compute the same step."""
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth":
            m.eval()
    return model


class TorchvisionBench(ResNet50Bench):
    """Any torchvision classification model (``--model NAME``, :func:`tilegemm.models.torchvision_models.names`)
    as :class:`ResNet50Bench` runs ResNet-50: random weights (seed 0), channels-last images of the size its
    default weights expect, its convolutions and Linears on tilegemm's kernels (``tilegemm.nn.convert_``) against
    the same model on cuDNN. The ``images`` sweep (the GPU's default): inference at batch 32 and 1, eager and
    under ``torch.compile``, then one training step at batch 32 (``train``: both models in training mode with
    dropout and stochastic depth off; its result is the parameters' gradients, flattened, against the same
    model's in fp32, or fp64 for fp32). Under the interpreter the ``tiny`` sweep runs a small ResNeXt (its
    grouped 3x3 of 2 channels a group and a depthwise 3x3), whatever NAME.
    """

    baseline_name = "cuDNN"
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    gpu_sweep, cpu_sweep = "images", "tiny"
    gpu_modes = ("eager", "graph", "compile", "compile-graph", "train")
    shape_help = ("BATCH[,MODE] (MODE: eager, graph, compile, compile-graph or train on a GPU; eager or train "
                  "under the interpreter)")
    MODES = {**ResNet50Bench.MODES,
             "train": "both eager, one training step (batch statistics; dropout and stochastic depth off; fp16 "
                      "with the loss scaled by the largest power of two up to 2^16 that keeps the gradients "
                      "finite, as GradScaler does), its result the parameters' gradients"}
    # Bounds on the relative error against the fp32 model (fp64 for fp32): inference as ResNet50Bench's fp16
    # one, bf16's 8x wider (3 fewer mantissa bits); a training step's gradients pass through the backward's
    # convolutions and batch norms in 16 bits too (the baseline's row shows cuDNN's own error beside them).
    INFERENCE_TOLERANCE = {"fp16": 2e-2, "bf16": 1.6e-1, "fp32": 1e-4}
    TRAIN_TOLERANCE = {"fp16": 5e-2, "bf16": 2e-1, "fp32": 1e-3}

    TINY_IMAGE = 16  # the small ResNeXt's images: a training step under the interpreter in seconds

    def __init__(self, model: str, batches: tuple[int, ...] = (32, 1)):
        from tilegemm.models import torchvision_models

        super().__init__(batches)
        try:
            torchvision_models.check_name(model)
        except ValueError as err:
            raise BenchError(str(err)) from None
        self.model, self.name = model, f"conv2d:{model}"
        self.GPU_IMAGE = torchvision_models.image_size(model)
        self.sweeps = {"images": self._images_cases, "inference": self._inference_cases, "tiny": self._tiny_cases}
        self._train = False  # the case prepare() made last is a training step (its tolerance)
        self._cudnn_err = 0.0  # cuDNN's relative error on that case

    def modes(self):
        return ("eager", "train") if interpreting() else self.gpu_modes

    def _require(self, tiny: bool) -> None:
        from tilegemm.models import torchvision_models

        if tiny:
            return
        try:
            torchvision_models.require_torchvision()
        except ImportError as err:
            raise BenchError(f"--model {self.model}: {err} (the tiny sweep runs without it)") from None
        if interpreting():
            raise BenchError(f"--model {self.model} at {self.GPU_IMAGE}x{self.GPU_IMAGE} needs a CUDA GPU; under the "
                             "interpreter run --sweep tiny")

    def _case(self, batch, mode, tiny, x):
        dims = dict(batch=batch, image=self.TINY_IMAGE if tiny else self.GPU_IMAGE, mode=mode,
                    config="tiny" if tiny else self.model)
        return Case(f"b{batch} {mode}", dims, float(x))

    def _images_cases(self) -> list[Case]:
        self._require(tiny=False)
        points = [(batch, mode) for batch in self.batches for mode in ("eager", "compile")]
        points.append((self.batches[0], "train"))
        return [self._case(batch, mode, False, i) for i, (batch, mode) in enumerate(points)]

    def _tiny_cases(self) -> list[Case]:
        return [self._case(2, "eager", True, 0), self._case(2, "train", True, 1)]

    def description(self, cases):
        d = cases[0].dims
        what = ("a small ResNeXt (a stem, one bottleneck with a grouped 3x3 of 2 channels a group, a depthwise "
                "3x3)" if d["config"] == "tiny" else f"torchvision's {self.model}")
        modes = "; ".join(f"{m} = {self.MODES[m]}" for m in dict.fromkeys(c.dims["mode"] for c in cases))
        baseline = "torch's CPU convolutions" if interpreting() else "cuDNN (benchmark mode)"
        return (f"{what}, random weights (seed 0; batch norms' running statistics from four random batches), "
                f"{d['image']}x{d['image']} channels-last images; "
                f"tilegemm.nn.convert_ (every convolution and Linear on tilegemm's kernels) against the same model on "
                f"{baseline}. Reference: the same model in fp32, tf32 off (fp64 for an fp32 run); inference compares "
                f"the logits, a training step the parameters' gradients. {modes}. Row fold (--kernels auto,fold): "
                f"convert_(fold_batchnorm=True), each batch norm and the activation after it in the convolution "
                f"before it in eval mode")

    def _build(self, tiny: bool) -> torch.nn.Module:
        from tilegemm.models import torchvision_models

        return torchvision_models.tiny_resnext() if tiny else torchvision_models.build(self.model)

    def _settle(self, model, dims):
        """Batch norms' running statistics from random batches (their initial ones let a random network's
        activations grow until fp16 overflows: both models' logits were inf on EfficientNet and MobileNetV3)."""
        from tilegemm.models.torchvision_models import calibrate_batch_norms

        return calibrate_batch_norms(model, dims["image"])

    def prepare(self, case, dtype, device, n_sets, options):
        self._train = case.dims["mode"] == "train"
        prepared = self._prepare(case, dtype, device, n_sets, options)
        # cuDNN's own error on this case, so the bound never fails a result as close as cuDNN's. Where cuDNN's
        # model fails (torch.compile, memory), the table's bound: the runner's check of the baseline reports the
        # failure in its row and tilegemm's rows still run, as they did before this check.
        self._cudnn_err = 0.0
        try:
            with _Precise(benchmark=True), torch.no_grad() if not self._train else contextlib.nullcontext():
                self._cudnn_err = relative_error(self.baseline(prepared.sets[0], dtype), prepared.reference)
        except Exception:  # noqa: BLE001 - reported by the baseline's row, not fatal to the case
            pass
        return prepared

    def _prepare(self, case, dtype, device, n_sets, options):
        if not self._train:
            return super().prepare(case, dtype, device, n_sets, options)
        import tilegemm.nn
        from tilegemm.models.torchvision_models import fp16_loss_scale, gradients

        self.release()
        d = case.dims
        ref, _, exact = self._models(d, dtype, device)
        ref = _train_deterministic(copy.deepcopy(ref))
        ours = _train_deterministic(tilegemm.nn.convert_(copy.deepcopy(ref)))
        exact = _train_deterministic(copy.deepcopy(exact))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(d["batch"], 3, d["image"], d["image"], generator=gen)
        x = x.to(device=device, dtype=self.dtypes[dtype]).contiguous(memory_format=torch.channels_last)
        target = torch.randint(0, 10, (d["batch"],), generator=gen).to(device)
        with _Precise(benchmark=False):
            reference = gradients(exact, x.to(next(exact.parameters()).dtype), target)
            # fp16 steps scale the loss as mixed-precision training does (the same scale on both sides):
            # unscaled, both models' gradients fell below fp16's normal range and missed the fp32 model's by 70-96%
            scale = fp16_loss_scale(ref, x, target) if dtype == "fp16" else 1.0
        inputs = dict(ours=lambda: gradients(ours, x, target, scale), ref=lambda: gradients(ref, x, target, scale))
        # row fold in training mode: its batch norms normalize by the batch, as torch's do (nothing is folded)
        folded = _lazy(lambda: (lambda m: lambda: gradients(m, x, target, scale))(
            tilegemm.nn.fold_batchnorm_(copy.deepcopy(ours))))
        inputs["fold"] = folded
        return Prepared([inputs], reference, bytes_per_set=x.numel() * x.element_size() + _nbytes(ref))

    def run(self, kernel, inputs, dtype):
        if not self._train:
            return super().run(kernel, inputs, dtype)
        return inputs["fold" if kernel == self.FOLD else "ours"]()

    def baseline(self, inputs, dtype):
        if not self._train:
            return super().baseline(inputs, dtype)
        return inputs["ref"]()

    def tolerance(self, dtype):
        # The runner asks right after prepare(): the bound of the case it made, or twice cuDNN's own error where
        # that is larger. A random deep network can be ill-conditioned in 16 bits whatever the kernels: ResNeXt-50's
        # fp16 training step gave cuDNN's gradients 0.71 from the fp32 model's, with the loss scaled or not, and
        # tilegemm's 0.72 (docs/conv2d.md, "Whole models").
        # cuDNN's error is inf where its result overflowed: then the table's bound (an inf bound passes anything)
        bound = (self.TRAIN_TOLERANCE if self._train else self.INFERENCE_TOLERANCE)[dtype]
        return max(bound, 2 * self._cudnn_err) if math.isfinite(self._cudnn_err) else bound


class MoEBench(ModelBench):
    """A transformers mixture-of-experts model (``--model qwen3_moe``: Qwen3-30B-A3B's shapes; ``--model mixtral``:
    Mixtral-8x7B's) with random weights, its experts on tilegemm's implementation (``experts_implementation=
    "tilegemm"``, row ``auto``) against the same model on transformers' ``grouped_mm`` (the baseline) and
    ``batched_mm`` (the second baseline): one model, its implementation switched between the rows.

    Cases: a greedy decode step at the prompt's length (one token per sequence, a static KV cache; ``graph``:
    replayed from a CUDA graph, ``compile``: torch.compile and then replayed; ``eager``), its last-position logits
    the result, and ``prefill``: the forward of a [batch, prompt] prompt (eager launches: at these sizes the GPU
    sets the pace), its last-position logits the result. Tokens a second: the batch for a decode step, the
    batch's prompt tokens for a prefill. The reference is the baseline's logits.
    """

    model = "qwen3_moe"
    arch = "qwen3_moe"
    metric = "tokens/s"
    baseline_name = "transformers grouped_mm"
    cpu_baseline_name = "transformers grouped_mm, CPU"
    second_baseline_name = "transformers batched_mm"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    gpu_sweep, cpu_sweep = "decode", "tiny"
    gpu_modes = ("graph", "compile", "prefill", "eager")
    shape_help = ("BATCH[,MODE] (MODE: graph, compile, prefill or eager on a GPU; eager or prefill under the "
                  "interpreter)")
    MODES = {**MODES, "prefill": "the prompt's forward, eager (no cache), its last position's logits"}

    GPU_PROMPT, TINY_PROMPT = 512, 8
    PREFILL, TINY_PREFILL = 2048, 16
    # The implementations sum each expert's products in other orders, and a near-tie of two experts' routing
    # scores can pick another expert for a token in one of them: the bound leaves room for that (measured:
    # docs/grouped.md, "Whole models").
    TOLERANCE = {"bf16": 5e-2, "fp16": 2e-2, "fp32": 1e-4}
    # At transformers' initialisation the experts move the logits by a few percent (each row records how much:
    # dims["experts_share"]), so the logits alone would pass experts that computed little; scaling them up made
    # the logits of a deep model chaotic (a near-tie in the routing flips, and every later layer's input moves).
    # Each case therefore also checks every layer's experts on the baseline's inputs (dims["experts_rel_err"]).
    EXPERTS_TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}
    _int4 = False  # the 4-bit entry's twin counts toward the layers that fit

    def __init__(self, layers: int | None = None, arch: str | None = None):
        super().__init__()
        if arch is not None:
            self.arch = self.model = arch
        self.name = f"grouped:{self.model}"
        self.layers = layers
        self.sweeps = {"decode": self._decode_cases, "tiny": self._tiny_cases}
        self._built = None  # (key, the model[s]): kept across cases
        self._impl = {}  # id(model) -> the experts implementation it was last set to

    def modes(self):
        return ("eager", "prefill") if interpreting() else self.gpu_modes

    def default_dtype(self):
        return "fp32" if interpreting() else "bf16"

    def second_baseline_reason(self, device):
        return None

    # --- cases

    def _require(self, tiny: bool) -> None:
        from tilegemm.models import moe
        from tilegemm.nn.moe import register_experts

        _require_transformers_model(self.model, moe.arch_of(self.arch)[3], tiny)
        if not register_experts():
            import transformers

            raise BenchError(f"--model {self.model} needs transformers' experts interface (transformers >= 5), "
                             f"this is {transformers.__version__}")

    def _case(self, batch: int, mode: str, tiny: bool, x: float) -> Case:
        from tilegemm.models import moe

        if tiny:
            layers, config = moe.TINY_LAYERS, "tiny"
        else:
            self.layers = moe.layers_that_fit(self.arch, self.layers, int4=self._int4)
            layers, config = self.layers, self.arch
        prompt = (self.TINY_PREFILL if tiny else self.PREFILL) if mode == "prefill" else \
            (self.TINY_PROMPT if tiny else self.GPU_PROMPT)
        dims = dict(batch=batch, prompt=prompt, layers=layers, mode=mode, config=config)
        return Case(f"b{batch} {mode}" + (f" {prompt}" if mode == "prefill" else ""), dims, float(x))

    def _decode_cases(self) -> list[Case]:
        self._require(tiny=False)
        points = [(batch, mode) for batch in (1, 16) for mode in ("graph", "compile")] + [(1, "prefill")]
        return [self._case(batch, mode, False, i) for i, (batch, mode) in enumerate(points)]

    def _tiny_cases(self) -> list[Case]:
        self._require(tiny=True)
        points = [(1, "eager"), (2, "eager"), (1, "prefill")]
        return [self._case(batch, mode, True, i) for i, (batch, mode) in enumerate(points)]

    def work(self, case, dtype, options):
        d = case.dims
        return float(d["batch"] * (d["prompt"] if d["mode"] == "prefill" else 1))

    def description(self, cases):
        from tilegemm.models import moe

        d = cases[0].dims
        _, full, full_layers, title, tiny_shapes = moe.arch_of(self.arch)
        tiny = d["config"] == "tiny"
        s = tiny_shapes if tiny else full
        modes = "; ".join(f"{m} = {self.MODES[m]}" for m in dict.fromkeys(c.dims["mode"] for c in cases))
        return (f"{'a tiny ' + self.arch if tiny else title + ' shapes'} (hidden {s['hidden_size']}, "
                f"{moe.experts_count(s)} experts of {moe.expert_width(s)}, top {s['num_experts_per_tok']}, heads "
                f"{s['num_attention_heads']}/{s['num_key_value_heads']} KV, vocab {s['vocab_size']}), {d['layers']} "
                f"layers{'' if tiny else ' of ' + str(full_layers)}, random weights; {self._what(tiny)}; every layer's "
                f"experts also checked on the baseline's inputs (rows: dims.experts_rel_err, dims.experts_share). "
                f"Decode: one "
                f"greedy step at position {self.TINY_PROMPT if tiny else self.GPU_PROMPT} after a prompt; {modes}")

    def _what(self, tiny: bool) -> str:
        return ("auto: the experts on tilegemm (experts_implementation='tilegemm'); baseline: transformers' "
                "grouped_mm; second baseline: its batched_mm; reference: the baseline's logits")

    # --- models and inputs

    def _models(self, dims: dict, dtype: torch.dtype, device: str) -> dict:
        """{row: model} (the rows' models, built on the first case and kept)."""
        from tilegemm.models import moe

        key = (dims["config"], dims["layers"], dtype, device)
        if self._built is None or self._built[0] != key:
            self._built = None
            self.release()
            with _seeded(device):
                model = moe.build(self.arch, tiny=dims["config"] == "tiny", layers=dims["layers"], device=device,
                                  dtype=dtype)
                ids = torch.randint(0, model.config.vocab_size, (2, 16), device=device)
            self._impl.clear()
            self._use(model, "grouped_mm")
            rows = self._rows(model, dims)  # the 4-bit entry writes its dequantized weights into the model here
            self._share = moe.experts_share(model, ids)
            (ref, ref_impl), (mine, impl) = rows["baseline"], rows["auto"]
            self._experts_err = moe.experts_agreement(
                ref, mine, ids, lambda m, which: self._use(m, ref_impl if which == "ref" else impl))
            self._built = (key, rows)
        return self._built[1]

    def _rows(self, model, dims) -> dict:
        return {"auto": (model, "tilegemm"), "baseline": (model, "grouped_mm"), "baseline2": (model, "batched_mm")}

    def _use(self, model, impl: str) -> None:
        from tilegemm.models import moe

        if self._impl.get(id(model)) != impl:  # set once: the timed calls of one row pay nothing for it
            moe.set_experts(model, impl)
            self._impl[id(model)] = impl

    def prepare(self, case, dtype, device, n_sets, options):
        self.release()
        d = case.dims
        rows = self._models(d, self.dtypes[dtype], device)
        model = next(iter(rows.values()))[0]
        batch, prompt_len, mode = d["batch"], d["prompt"], d["mode"]
        prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                               generator=torch.Generator().manual_seed(0)).to(device)
        self._compiled = self._compiled or mode == "compile"
        d["experts_share"] = round(self._share, 4)  # what a check of the logits can see of the experts
        d["experts_rel_err"] = float(f"{self._experts_err:.3g}")
        calls, decoders = {}, {}
        for row, (m, impl) in rows.items():
            self._use(m, impl)
            if mode == "prefill":
                calls[row] = self._prefill_call(m, impl, prompt)
                continue
            dec = llama.Decoder(m, batch, prompt_len + 1, device, graph=mode == "graph", compiled=mode == "compile",
                                repeat=True)
            # the prompt on grouped_mm where the row is batched_mm, which copies each token's experts' weights (16
            # x 512 tokens of Qwen3-30B-A3B: 600 GB); the cache it fills is the same
            self._use(m, "grouped_mm" if impl == "batched_mm" else impl)
            dec.prefill(prompt)
            decoders[row] = dec
        for row, dec in decoders.items():
            m, impl = rows[row]
            self._use(m, impl)
            # every row steps on the baseline's next token: its own argmax may differ on a near-tie (bf16), and
            # the logits after two different tokens are not comparable
            dec.ids.copy_(decoders["baseline"].ids)
            if dec.graph:
                dec.capture()  # a replay no longer reads the implementation
                calls[row] = dec.next_logits
            else:
                calls[row] = self._eager_call(m, impl, dec.next_logits)
        bound = self.EXPERTS_TOLERANCE[dtype]
        if self._experts_err > bound:  # the row fails with what was found, whatever its logits say
            err = self._experts_err

            def disagree():
                raise RuntimeError(f"the experts disagree with {rows['baseline'][1]}'s on the same inputs: relative "
                                   f"error {err:.3g} in a layer (bound {bound:g})")
            calls["auto"] = disagree
        reference = calls["baseline"]().float()
        return Prepared([calls], reference, bytes_per_set=0)

    def _eager_call(self, model, impl, fn):
        def call():
            self._use(model, impl)
            return fn()
        return call

    def _prefill_call(self, model, impl, prompt):
        if impl == "batched_mm":
            need = _batched_mm_bytes(model, prompt.numel())
            free = torch.cuda.mem_get_info()[0] if prompt.is_cuda else float("inf")
            if need > free:
                def refuse():
                    raise RuntimeError(f"not run: batched_mm copies each token's experts' weights, "
                                       f"{need / 2**30:.0f} GiB for {prompt.numel()} tokens")
                return refuse

        @torch.no_grad()
        def call():
            self._use(model, impl)
            return model(input_ids=prompt, use_cache=False, logits_to_keep=1).logits[:, -1]
        return call

    def run(self, kernel, inputs, dtype):
        return inputs["auto"]()

    def baseline(self, inputs, dtype):
        return inputs["baseline"]()

    def second_baseline(self, inputs, dtype):
        return inputs["baseline2"]()

    def tolerance(self, dtype):
        return self.TOLERANCE[dtype]


def _batched_mm_bytes(model, tokens: int) -> int:
    """The bytes transformers' batched_mm gathers for one block at ``tokens`` tokens: each token-expert pair's
    copy of the expert's weights."""
    from tilegemm.models import moe

    cfg = model.config
    shapes = dict(hidden_size=cfg.hidden_size, moe_intermediate_size=getattr(cfg, "moe_intermediate_size", None),
                  intermediate_size=cfg.intermediate_size)
    per_expert = 3 * cfg.hidden_size * moe.expert_width(shapes) * model.dtype.itemsize
    return tokens * cfg.num_experts_per_tok * per_expert


class MixtralBench(MoEBench):
    """:class:`MoEBench` on Mixtral-8x7B's shapes (8 experts of 14336, top 2)."""

    model = arch = "mixtral"


class MoEInt4Bench(MoEBench):
    """:class:`MoEBench` with the experts 4-bit (``--op grouped_w4a16 --model qwen3_moe``): row ``auto`` runs a copy
    that ``tilegemm.nn.quantize_`` made 4-bit (the experts and every Linear but lm_head: :func:`tilegemm.models.moe.
    int4_twin`; group 128, the tiny model's 32), against the 16-bit
    model holding those 4-bit weights dequantized (so both compute the same product, and its logits are the
    reference) on transformers' ``grouped_mm`` and ``batched_mm``."""

    _int4 = True

    def __init__(self, layers: int | None = None, arch: str | None = None):
        super().__init__(layers, arch)
        self.name = f"grouped_w4a16:{self.model}"

    def default_dtype(self):
        return "fp16" if interpreting() else "bf16"

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the 4-bit experts take 16-bit activations

    def _what(self, tiny: bool) -> str:
        return (f"auto: a copy whose experts and Linears but lm_head are 4-bit (tilegemm.nn.quantize_, group "
                f"{self._group(tiny)}) on tilegemm; baseline: the 16-bit model holding those weights dequantized, on "
                "transformers' grouped_mm; second baseline: its batched_mm; reference: the baseline's logits; row "
                "fused (--kernels auto,fused): the 4-bit copy after tilegemm.nn.fuse_projections_")

    @staticmethod
    def _group(tiny: bool) -> int:
        from tilegemm.models import moe

        return moe.TINY_GROUP if tiny else moe.GROUP

    # Row ``fused`` (named with --kernels): a copy of the 4-bit model with its projections joined
    # (fuse_projections_: the attention's q/k/v, dense or shared experts' gate/up); made only when asked for.
    FUSED = "fused"
    _want_fused = False

    def check_kernel(self, name):
        if name == self.FUSED:
            self._want_fused = True
            return
        super().check_kernel(name)

    def _rows(self, model, dims) -> dict:
        from tilegemm.models import moe

        int4 = moe.int4_twin(model, self._group(dims["config"] == "tiny"))
        rows = {"auto": (int4, "tilegemm"), "baseline": (model, "grouped_mm"), "baseline2": (model, "batched_mm")}
        if self._want_fused:
            from tilegemm.nn import absorb_act_order_, fuse_projections_

            rows[self.FUSED] = (fuse_projections_(absorb_act_order_(copy.deepcopy(int4))), "tilegemm")
        return rows

    def run(self, kernel, inputs, dtype):
        return inputs[self.FUSED if kernel == self.FUSED else "auto"]()


class MixtralInt4Bench(MoEInt4Bench):
    """:class:`MoEInt4Bench` on Mixtral-8x7B's shapes."""

    model = arch = "mixtral"
