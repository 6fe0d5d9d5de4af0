"""The files one ``tilegemm.matmul`` call enters: its route to the launch, and every file whose code runs.

The route: the files on the call stack at each kernel launch, from the public function down (the path the
call takes). Every file: each one whose function ran during the call, in the order first entered, which adds
the files answering questions on the way (tuned tables, the hardware, the cost model) and returning at once.

Every module tilegemm ships is imported first, so the count is the call's route and not the imports it
triggers; a profile hook then records each Python frame that runs in a file under ``src/tilegemm`` during the
call (the first call on a shape, which chooses and compiles its kernel, then the same call again, which
replays the first one's launch). A file "entered" is one whose function ran; ``<module>`` frames (an import
inside a function) are listed apart, and under the interpreter the kernels' own code (which it runs as Python)
is left out: on a GPU it is compiled, not entered. ``downward`` says that no function of ``core/`` called one of ``ops/``
(the route never climbs back from the shared pipeline into a family).

    PYTHONPATH=src python3 tools/call_route.py [--shapes 4096x4096x4096,1x4096x4096] [--dtypes fp16,bf16] \
        [--out route.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys


def _import_everything() -> None:
    """Imports every shipped module, so that a call's route holds no import."""
    import tilegemm

    for info in pkgutil.walk_packages(tilegemm.__path__, "tilegemm."):
        try:
            importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: its module is not on a matmul call's route
            pass


def _under_interpreter(frame) -> bool:
    """Whether Triton's interpreter runs this frame as a kernel's (or device function's) code."""
    f = frame.f_back
    while f is not None:
        if "triton" in f.f_code.co_filename and "interpreter" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def route(fn) -> dict:
    import tilegemm

    root = os.path.dirname(tilegemm.__file__) + os.sep
    order: list[str] = []
    modules: list[str] = []
    upward: list[str] = []  # calls from a core/ function into an ops/ one
    chains: list[list[str]] = []  # the files on the stack at each kernel launch, from the public function down

    def hook(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(root):
            return
        rel = path[len(root):]
        if _under_interpreter(frame):
            return
        if frame.f_code.co_name == "<module>":
            if rel not in modules:
                modules.append(rel)
            return
        # A kernel's launch, or a replay's: the files on the stack then are the route.
        if rel == "core/launch.py" and frame.f_code.co_name in ("launch", "__call__"):
            chain, f = [], frame
            while f is not None:
                name = f.f_code.co_filename
                if name.startswith(root) and name[len(root):] not in chain:
                    chain.append(name[len(root):])
                f = f.f_back
            chains.append(chain[::-1])
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if rel.startswith("ops/") and caller.startswith(root + "core" + os.sep):
            upward.append(f"{caller[len(root):]}->{rel}:{frame.f_code.co_name}")
        if rel not in order:
            order.append(rel)

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    path: list[str] = []
    for chain in chains:
        path += [f for f in chain if f not in path]
    return {"route": path, "route_count": len(path), "files": order, "count": len(order), "imports_run": modules, "downward": not upward,
            "upward_calls": sorted(set(upward))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x4096x4096,1x4096x4096,64x11008x4096,1000x1000x1000")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    import tilegemm

    _import_everything()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    rows = []
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        for name in args.dtypes.split(","):
            dt = dtypes[name]
            a = torch.randn(m, k, device=device).to(dt)
            b = torch.randn(k, n, device=device).to(dt)
            for which in ("first", "second"):  # the second replays the first where replays run (a GPU)
                r = route(lambda: tilegemm.matmul(a, b))
                if device == "cuda":
                    torch.cuda.synchronize()
                rows.append({"shape": shape, "dtype": name, "call": which, **r})
    for r in rows:
        print(f"{r['shape']:>16} {r['dtype']:>5} {r['call']:>8} route {r['route_count']} files "
              f"({'downward' if r['downward'] else 'UP: ' + ','.join(r['upward_calls'])}): {' '.join(r['route'])}")
        print(f"{'':>31} all {r['count']} files: {' '.join(r['files'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
