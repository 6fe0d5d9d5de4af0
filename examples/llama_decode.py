"""Greedy decoding of a Llama-architecture model with 4-bit weights (``tilegemm.nn.quantize_``), random weights.

    python examples/llama_decode.py                  # GPU: Llama-3-8B shapes, as many layers as fit (<= 32)
    python examples/llama_decode.py --layers 8 --prompt 512 --new 128 --batches 1,16
    python examples/llama_decode.py --tiny           # CI: a tiny config on the CPU under Triton's interpreter

Builds ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` (hidden 4096, intermediate 14336, 32 heads, 8 KV
heads, vocab 128256), in fp16 with random weights; a copy gets ``tilegemm.nn.quantize_`` (g128, every Linear
but lm_head). Prints, for batch 1 and 16: prefill time of the prompt and decode tokens/s of the greedy loop
(a static KV cache; the decode step run eagerly, replayed from a CUDA graph, or compiled by ``torch.compile`` and
replayed from a CUDA graph, ``--modes``) for the fp16 model
and the int4 one, and their ratio; then the logits' agreement of the int4 model with the same model dequantized to fp16 (relative error of the
last position's logits, share of positions whose argmax agrees, and the step where the greedy tokens first
differ). Needs ``pip install tilegemm[models]`` (transformers).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
import time

import tilegemm  # first: it settles Triton's backend (compiler or interpreter) before triton is imported

import torch


def build(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=args.layers or 2, vocab_size=256, max_position_embeddings=256)
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                          num_hidden_layers=args.layers or 32, vocab_size=128256, max_position_embeddings=8192,
                          rope_theta=500000.0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)  # random init (normal, std = initializer_range)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def layers_that_fit(args) -> int:
    """Llama-3-8B layers that fit: an fp16 layer (436 MB) twice while the copy is made (then its int4 form,
    about 125 MB), the embedding and lm_head in fp16 twice (4.2 GB) and room for the KV cache and activations."""
    if args.layers:
        return args.layers
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(32, int((free / 2**30 - 4.2 - 8.0) / 0.9)))  # deepcopy holds two fp16 layers at once


def forward(model, ids, past=None, position=None):
    """(logits of the last position [B, V], the cache); only the last position's logits are computed."""
    kwargs = dict(input_ids=ids, past_key_values=past, use_cache=True)
    if position is not None:
        kwargs["cache_position"] = position
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:  # transformers >= 4.50
        kwargs["logits_to_keep"] = 1
    elif "num_logits_to_keep" in params:
        kwargs["num_logits_to_keep"] = 1
    out = model(**kwargs)
    return out.logits[:, -1], out.past_key_values


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def static_cache(model, batch: int, max_len: int, device):
    """A ``transformers.StaticCache`` of ``max_len`` positions, allocated now (fixed addresses: a CUDA graph of
    the decode step reads and writes the same tensors at every replay)."""
    from transformers import StaticCache

    cfg = model.config
    params = inspect.signature(StaticCache.__init__).parameters
    if "max_batch_size" in params:  # transformers 4.x
        return StaticCache(config=cfg, max_batch_size=batch, max_cache_len=max_len, device=device,
                           dtype=torch.float16)
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(batch, cfg.num_key_value_heads, head_dim, torch.float16, torch.device(device))
    return cache


class Decoder:
    """Greedy decoding with a static KV cache. ``graph=True`` replays the one-token step from a CUDA graph
    (captured once per batch size), so the host's Python (transformers, tilegemm's wrappers) costs nothing
    per token; ``graph=False`` runs it eagerly. ``compiled=True`` (with ``graph``) runs the step through
    ``torch.compile`` first (fixed shapes): Inductor fuses the norms, rotary embedding and elementwise work
    around the Linears, which stay calls of their ops (cuBLAS, or ``tilegemm::w4a16_matmul``); the prompt's
    prefill stays eager."""

    def __init__(self, model, batch: int, max_len: int, device, graph: bool, compiled: bool = False):
        self.model, self.device, self.graph = model, device, graph or compiled
        self.cache = static_cache(model, batch, max_len, device)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.logits = None
        self.cuda_graph = None
        self.step_fn = self._step
        if compiled:
            self.step_fn = torch.compile(self._step, dynamic=False)

    def _step(self, ids, pos):
        return forward(self.model, ids, self.cache, pos)[0]

    def step(self):
        return self.step_fn(self.ids, self.pos)

    def capture(self):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up on a side stream, as torch.cuda.graphs asks
                self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.cuda_graph):
            self.logits = self.step()

    @torch.no_grad()
    def run(self, prompt, new_tokens):
        """(prefill seconds, decode seconds, generated tokens [B, new_tokens])."""
        P = prompt.shape[1]
        if self.graph and self.cuda_graph is None:
            forward(self.model, prompt, self.cache, torch.arange(P, device=self.device))
            self.pos.fill_(P)
            self.capture()
        self.cache.reset()
        sync(self.device)
        t0 = time.perf_counter()
        logits, _ = forward(self.model, prompt, self.cache, torch.arange(P, device=self.device))
        tok = logits.argmax(-1, keepdim=True)
        sync(self.device)
        t1 = time.perf_counter()
        out = [tok]
        for i in range(new_tokens - 1):
            self.ids.copy_(tok)
            self.pos.fill_(P + i)
            if self.graph:
                self.cuda_graph.replay()
                logits = self.logits
            else:
                logits = self.step()
            tok = logits.argmax(-1, keepdim=True)
            out.append(tok)
        sync(self.device)
        return t1 - t0, time.perf_counter() - t1, torch.cat(out, 1)


@torch.no_grad()
def greedy(model, prompt, new_tokens, device, graph=False):
    """(prefill seconds, decode seconds, generated tokens [B, new_tokens]) of one greedy run."""
    return Decoder(model, prompt.shape[0], prompt.shape[1] + new_tokens, device, graph).run(prompt, new_tokens)


@torch.no_grad()
def dequantized_copy_into(fp16_model, int4_model) -> None:
    """Overwrite ``fp16_model``'s quantized Linears with the int4 model's weights, dequantized (in place: no third
    copy of the model)."""
    from tilegemm.nn import Int4Linear

    int4 = dict(int4_model.named_modules())
    for name, module in fp16_model.named_modules():
        if isinstance(int4.get(name), Int4Linear):
            module.weight.copy_(int4[name].dequantize().to(module.weight.dtype))


@torch.no_grad()
def agreement(int4_model, ref_model, prompt) -> dict:
    """Logits of every prompt position from both models: relative error (last position), argmax agreement."""
    a = int4_model(input_ids=prompt).logits.float()
    b = ref_model(input_ids=prompt).logits.float()
    last = float((a[:, -1] - b[:, -1]).norm() / b[:, -1].norm())
    same = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return dict(rel_err_last=last, argmax_agree=same)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config on the CPU (interpreter), no timing claims")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: as many as fit, <= 32)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; --tiny 8)")
    parser.add_argument("--new", type=int, default=None, help="generated tokens (default 128; --tiny 4)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16; --tiny 1,2)")
    parser.add_argument("--group-size", type=int, default=None, help="quantization group (default 128; --tiny 32)")
    parser.add_argument("--modes", default=None,
                        help="eager,graph,compile (GPU default: all three; the CPU: eager)")
    args = parser.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("needs transformers: pip install 'tilegemm[models]'", file=sys.stderr)
        return 2
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.tiny:
        print("no CUDA GPU: use --tiny", file=sys.stderr)
        return 2
    prompt_len = args.prompt or (8 if args.tiny else 512)
    new_tokens = args.new or (4 if args.tiny else 128)
    batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,16")).split(",")]
    group = args.group_size or (32 if args.tiny else 128)
    if device == "cuda":
        args.layers = layers_that_fit(args)
    torch.manual_seed(0)

    model = build(args, device)
    cfg = model.config
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}")
    print(f"model: Llama, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, heads "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} KV, vocab {cfg.vocab_size}, "
          f"{cfg.num_hidden_layers} layers{'' if args.tiny or cfg.num_hidden_layers == 32 else ' (of 32: what fits)'}"
          f", random fp16 weights")
    qmodel = copy.deepcopy(model)
    tilegemm.nn.quantize_(qmodel, group_size=group, filter=lambda name, m: "lm_head" not in name)
    from tilegemm.nn import Int4Linear

    n_int4 = sum(isinstance(m, Int4Linear) for m in qmodel.modules())
    fp16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    int4_bytes = sum(t.numel() * t.element_size() for t in list(qmodel.parameters()) + list(qmodel.buffers()))
    print(f"weights: fp16 {fp16_bytes / 2**30:.2f} GiB, int4 ({n_int4} Linears, g{group}; lm_head, embedding fp16) "
          f"{int4_bytes / 2**30:.2f} GiB")

    described = {"eager": "eager PyTorch", "graph": "decode step replayed from a CUDA graph",
                 "compile": "decode step compiled by torch.compile, replayed from a CUDA graph"}
    modes = ["eager"] if device == "cpu" else ["eager", "graph", "compile"]
    if device == "cuda" and args.modes:
        modes = args.modes.split(",")
    unknown = [m for m in modes if m not in described]
    if unknown:
        print(f"unknown mode(s) {unknown}: choose from {', '.join(described)}", file=sys.stderr)
        return 2
    print(f"greedy decode: {prompt_len}-token prompt, {new_tokens} new tokens, static KV cache; modes: "
          + ", ".join(described[m] for m in modes))
    results = []
    for batch in batches:
        prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
        for mode in modes:
            line = [f"batch {batch:3d} {mode:7s}:"]
            tps = {}
            for name, m in (("fp16", model), ("int4", qmodel)):
                dec = Decoder(m, batch, prompt_len + new_tokens, device, graph=mode == "graph",
                              compiled=mode == "compile")
                if device == "cuda":
                    dec.run(prompt, 4)  # warm-up: compiles, replays recorded, cuBLAS handles, the graph
                pre, secs, _ = dec.run(prompt, new_tokens)
                tps[name] = batch * (new_tokens - 1) / secs
                line.append(f"{name} prefill {pre * 1e3:8.1f} ms, decode {tps[name]:9.1f} tok/s")
                del dec
            line.append(f"int4/fp16 {tps['int4'] / tps['fp16']:.2f}x")
            results.append(dict(batch=batch, mode=mode, **{f"{k}_tok_s": v for k, v in tps.items()}))
            print("  ".join(line), flush=True)

    # Agreement with the same weights dequantized to fp16 (the fp16 model's Linears overwritten in place).
    dequantized_copy_into(model, qmodel)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), device=device)
    agree = agreement(qmodel, model, prompt)
    _, _, t_q = greedy(qmodel, prompt, new_tokens, device)
    _, _, t_r = greedy(model, prompt, new_tokens, device)
    diff = (t_q != t_r).nonzero()
    first = int(diff[0, 1]) if len(diff) else None
    print(f"int4 vs fp16-dequantized: last-position logits rel. error {agree['rel_err_last']:.2e}, argmax agrees "
          f"at {agree['argmax_agree'] * 100:.1f}% of prompt positions, greedy tokens "
          + ("identical" if first is None else f"first differ at step {first}") + f" (of {new_tokens})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
