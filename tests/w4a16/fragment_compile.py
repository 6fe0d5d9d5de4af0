"""Offline sm_90 compiles of the fragment kernels (``frag``, ``frag_wgmma``) for the tests: no GPU needed."""

from __future__ import annotations

import textwrap

from conftest import SM90, compile_offline

_SCRIPT = SM90 + textwrap.dedent(
    """
    import importlib, json, re, sys
    import torch

    report = {}
    for name, v in json.loads(sys.argv[1]).items():
        module = importlib.import_module("tilegemm.ops.w4a16." + v["module"])
        dt = getattr(torch, v["dtype"])
        M, N, K = v["mnk"]
        x = torch.empty(M, K, dtype=dt)
        fw = torch.empty(-(-N // 256) * 16, -(-K // 128) * 2, 32, 4, dtype=torch.int32)
        fzs = torch.empty(8, fw.shape[0], 8, 4, dtype=dt)
        out = torch.empty(M, N, dtype=dt)
        bias = torch.empty(N, dtype=dt) if v["bias"] else None
        kernel, grid, args, kwargs = module.launch_args(x, fw, fzs, bias, out, N, K, 128, v["act"], v["cfg"])
        sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
        compiled, ptx, info = compile_sm90(kernel, sig, constexprs, attrs, kwargs["num_warps"])
        report[name] = dict(
            mma_sync=len(re.findall(r"mma\\.sync\\.aligned\\.m16n8k16", ptx)),
            wgmma=len(re.findall(r"wgmma\\.mma_async", ptx)),
            lop3=len(re.findall(r"lop3\\.b32", ptx)),
            wide_loads=len(re.findall(r"ld\\.global(?:\\.[a-z0-9]+)*\\.v4\\.b32", ptx)),
            cp_async=len(re.findall(r"cp\\.async\\.c[ag]\\.shared\\.global \\[[^]]+\\], \\[[^]]+\\], 0x10", ptx)),
            shared=compiled.metadata.shared,
            serialized="serialized" in info,
            spills=[int(n) for n in re.findall(r"(\\d+) bytes spill stores", info)],
        )
    print(json.dumps(report))
    """
)


def compile_report(tmp_path, module: str, variants: dict) -> dict:
    """Per variant (dtype, mnk, bias, act, cfg), what the sm_90 compile of ``module``'s kernel holds: MMA and
    LOP3 counts, 16-byte loads and cp.async copies, shared memory, serialized wgmma, spills."""
    return compile_offline(tmp_path, _SCRIPT, {k: dict(v, module=module) for k, v in variants.items()}, timeout=600)
