"""How fast can the packed int4 words of a weight be read at all, with the L2 cleared? A kernel that only XORs
the words (no dequantization, no multiply) over the same bytes as a W4A16 product at M = 1, against cuBLAS fp16
and the shipped small-M kernels: the gap between the stream and the kernels is what dequantization, the
multiply and the reduction cost; the gap between the stream and HBM's peak is the memory system's own.
Each time twice: with the L2 cleared as ``do_bench`` clears it (a written buffer: dirty lines to write back
during the timed call) and by a read (clean lines).

    PYTHONPATH=src python3 research/probe_w4a16_stream.py --json $OUT/w4a16-stream.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tilegemm import w4a16
from tilegemm.core.hardware import machine_info


class Cold:
    """GPU microseconds of ``fn`` with the L2 cleared before each call: a CUDA graph of ``reps`` x (clear a 256 MB
    buffer, call) minus a graph of the clearing alone, divided by ``reps``; median of five replays."""

    def __init__(self, reps: int = 20, flush: str = "write"):
        """``flush``: "write" zeroes the buffer (as ``do_bench`` does: the L2 is left full of dirty lines, which
        the timed call writes back as it reads); "read" reads it (clean lines, nothing to write back)."""
        self.reps = reps
        self.buf = torch.zeros(256 * 2**20, dtype=torch.int8, device="cuda")
        self.sink = torch.empty(1, dtype=torch.int32, device="cuda")
        self.flush = {"write": self.buf.zero_, "read": self._read}[flush]
        self.base = self._graph_ms(None)

    def _read(self):
        torch.amax(self.buf.view(torch.int32), 0, keepdim=True, out=self.sink)

    def _graph_ms(self, fn) -> float:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            if fn is not None:
                fn()  # warm: compile and record outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                for _ in range(self.reps):
                    self.flush()
                    if fn is not None:
                        fn()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        del g
        return sorted(times)[2]

    def __call__(self, fn) -> float:
        return (self._graph_ms(fn) - self.base) / self.reps * 1e3


@triton.jit
def stream_kernel(src, out, per_prog, total, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * per_prog
    acc = tl.zeros([BLOCK], tl.int32)
    offs = tl.arange(0, BLOCK)
    for i in tl.range(0, per_prog, BLOCK, num_stages=STAGES):
        idx = base + i + offs
        acc ^= tl.load(src + idx, mask=idx < total, other=0)
    tl.store(out + pid, tl.xor_sum(acc, 0))


def stream(words: torch.Tensor, progs: int, block: int, warps: int, stages: int):
    total = words.numel()
    per = triton.cdiv(triton.cdiv(total, progs), block) * block
    grid = triton.cdiv(total, per)
    out = torch.empty(grid, dtype=torch.int32, device=words.device)

    def fn():
        stream_kernel[(grid,)](words, out, per, total, BLOCK=block, STAGES=stages, num_warps=warps)
    return fn


STREAMS = ((16, 4096, 8, 1), (16, 2048, 8, 1), (8, 2048, 8, 1), (4, 1024, 4, 3), (8, 1024, 4, 3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="8192x8192,28672x8192,4096x4096,14336x4096,4096x14336")
    ap.add_argument("--ms", default="1,4,16")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flushes = {"write": Cold(flush="write"), "read": Cold(flush="read")}
    rows = []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        torch.manual_seed(0)
        weight = torch.randn(n, k, dtype=torch.float16, device="cuda") / k**0.5
        w = w4a16.quantize(weight, group_size=128)
        words = w.fragments()[0].reshape(-1)
        nbytes = words.numel() * 4
        for flush, cold in flushes.items():
            row = {"shape": shape, "flush": flush, "bytes": nbytes, "us": {}}
            for per_sm, block, warps, stages in STREAMS:
                row["us"][f"stream p{per_sm} b{block} w{warps} s{stages}"] = cold(
                    stream(words, per_sm * sms, block, warps, stages))
            best = min((v, kk) for kk, v in row["us"].items())
            row["stream"] = best[0]
            line = [f"{shape:>11} {flush:>5}: stream {best[0]:5.1f} us ({nbytes / best[0] / 1e3:4.0f} GB/s)"]
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                t = {"cublas": cold(lambda: F.linear(x, weight))}
                for kern in ("frag_wgmma", "gemv"):
                    try:
                        t[kern] = cold(lambda kern=kern: w4a16.matmul(x, w, kernel=kern))
                    except Exception:  # noqa: BLE001 - a kernel that does not take the case is left out
                        pass
                row["us"].update({f"M{m} {kk}": v for kk, v in t.items()})
                line.append(f"M={m}: cuBLAS {t['cublas']:5.1f} " + " ".join(
                    f"{kk} {t['cublas'] / v:4.2f}x" for kk, v in t.items() if kk != "cublas"))
            line.append(f"(stream {row['us']['M1 cublas'] / best[0]:4.2f}x)")
            print("  ".join(line), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info().to_dict(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
