"""The ``tilegemm`` command's entry point and its parser, outside the ``tilegemm`` package.

Importing the package imports torch (it settles Triton's backend and registers the op families: 2-3 s), which
``tilegemm --help`` need not wait for: the parser is built here and help is answered before anything of tilegemm
is imported; every command (and ``bench --help``, which lists the registered ops) runs in :mod:`tilegemm.cli`.
"""

from __future__ import annotations

import argparse
import os
import sys

EXAMPLES = """\
examples:
  tilegemm bench                                  default sweep (GPU: square fp16; CPU: a tiny one)
  tilegemm bench --sweep llm --dtype bf16 --plot llm.png
  tilegemm bench --shape 4096,4096,4096 --shape 16,28672,8192 --kernels grouped,autotuned
  tilegemm bench --layout TN --batch 8 --sweep square
  tilegemm bench --op w4a16 --model llama         decode tokens/s of a 4-bit Llama against the same model in fp16
  tilegemm bench --op w4a16 --model llama --checkpoint DIR   the same, of a GPTQ/AWQ checkpoint directory
  tilegemm bench --op conv2d --model resnet50 --shape 64,compile
  tilegemm tune --sweep llm --dtype bf16          tune ahead of time; configs saved per GPU
  tilegemm info
"""


class UsageError(Exception):
    """A bad command line: printed as one line, exit code 2."""


# Options whose value may start with '-' (a negative size, which the op's parser then names): argparse takes
# "--shape -1,8,8" for an option and says only "expected one argument".
_DASH_VALUES = ("--shape",)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):
        rest, joined = list(sys.argv[1:] if args is None else args), []
        while rest:
            arg = rest.pop(0)
            if arg in _DASH_VALUES and rest and rest[0][:1] == "-" and rest[0][1:2].isdigit():
                arg = f"{arg}={rest.pop(0)}"
            joined.append(arg)
        return super().parse_known_args(joined, namespace)


def _op_help() -> tuple[str, str, str, str]:
    """What the registered ops offer, for --help: their names, dtypes, sweeps and model entries."""
    from tilegemm.bench.base import bench_op, bench_ops

    names = bench_ops()
    adapters = [bench_op(name) for name in names]
    dtypes = "; ".join(f"{a.name}: {', '.join(a.dtypes)}" for a in adapters)
    sweeps = "; ".join(f"{a.name}: {', '.join(a.sweeps)}" for a in adapters)
    models = ", ".join(f"{a.name}:{model} (sweeps {', '.join(a.model_bench(model).sweeps)})"
                       for a in adapters for model in a.models)
    return ", ".join(names), dtypes, sweeps, models


def _add_bench(sub, detailed: bool) -> None:
    p = sub.add_parser(
        "bench", help="check and time kernels against their baseline over a sweep of shapes",
        description="Check every kernel's result against a float64 reference, time it with "
                    "triton.testing.do_bench (median), and compare it with the baseline (cuBLAS for matmul).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The registered ops' names, dtypes and sweeps, for `bench --help` and bench runs only: reading them loads
    # the bench and every op family, which other commands' --help need not wait for.
    ops, dtypes, sweeps, models = _op_help() if detailed else ("see `tilegemm bench --help`",) * 4
    p.add_argument("--op", default="matmul", help=f"op: {ops}; default matmul")
    p.add_argument("--model", metavar="NAME",
                   help=f"time a whole model on the op's kernels against the same model on the baseline's, instead "
                        f"of the op's kernels; op:model: {models}; --shape then takes BATCH[,MODE]; "
                        f"docs/bench.md says what each times")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="--op w4a16 --model llama: load the model from a 4-bit GPTQ/AWQ checkpoint directory "
                        "(tilegemm.models.from_pretrained) instead of quantizing random weights")
    p.add_argument("--layers", type=int, metavar="N",
                   help="--model llama, qwen2, qwen3_moe, mixtral: decoder layers of the full-size model (default: "
                        "as many as fit)")
    p.add_argument("--dtype", help=f"input dtype (the first is the default); {dtypes}")
    p.add_argument("--sweep", help=f"named sweep; {sweeps}; default: the op's GPU sweep on a GPU, its tiny one "
                                   "under the interpreter")
    p.add_argument("--shape", action="append", default=[], metavar="M,N,K",
                   help="a shape to run instead of a sweep (repeatable)")
    p.add_argument("--shapes", metavar="FILE", help="a file of shapes, one per line ('#' starts a comment)")
    p.add_argument("--kernels", default="all", help="comma-separated kernel names, or 'all' (default)")
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline (no ratios)")
    p.add_argument("--layout", default=None, choices=["NN", "NT", "TN", "TT"],
                   help="matmul: T reads that operand as a transposed view (default NN; NT for fp8)")
    p.add_argument("--batch", type=int, default=1, help="matmul: batch count (default 1)")
    p.add_argument("--mode", default="fwd", choices=["fwd", "bwd", "dgrad", "wgrad"],
                   help="conv2d and grouped: time the forward pass (default) or the backward pass (the gradients "
                        "of the inputs and weights); conv2d also dgrad or wgrad, one of the two alone")
    p.add_argument("--memory-format", default="channels_last", choices=["channels_last", "nchw"],
                   help="conv2d: the activations' and weights' layout on both sides (default channels_last; "
                        "nchw: contiguous, as torch makes them)")
    p.add_argument("--fast-accum", action="store_true",
                   help="matmul fp8: accumulate without fp32 promotion, tilegemm and torch._scaled_mm "
                        "(use_fast_accum=True) alike")
    p.add_argument("--warmup", type=float, default=25.0, metavar="MS", help="warm-up time in ms (default 25)")
    p.add_argument("--rep", type=float, default=100.0, metavar="MS", help="timing time in ms (default 100)")
    p.add_argument("--rounds", type=int, default=None, metavar="R",
                   help="split the timing into R rounds that each time every kernel and the baseline, in "
                        "alternating order (default 3 on a GPU, 1 under the interpreter)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time CUDA-graph replays (takes launch overhead out; inputs rotated past L2)")
    p.add_argument("--precompile", type=int, default=0, metavar="J",
                   help="before timing, compile every case's kernels into Triton's disk cache in J worker "
                        "processes (-1: min(16, CPUs - 1); default 0, off); a GPU run only")
    p.add_argument("--json", metavar="PATH", help="write rows and machine details as JSON")
    p.add_argument("--csv", metavar="PATH", help="write rows as CSV (machine details in '#' header lines)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of rate against the sweep for the top-k kernels")
    p.add_argument("--topk", type=int, default=None, help="kernels in the plot (default 4)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where JSON, CSV and PNG go when no path is given (default ./tilegemm-bench)")
    p.add_argument("--no-save", action="store_true", help="write no files unless --json/--csv/--plot say so")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_info(sub) -> None:
    sub.add_parser("info", help="device, peak rates, versions, backend, caches and registered kernels",
                   description="Print the GPU in use (or the interpreter), its datasheet peaks, the versions of torch, "
                               "triton and tilegemm, where compiled kernels and tuned configs are kept, and every "
                               "registered kernel with a line on what it is.")


def _add_tune(sub) -> None:
    p = sub.add_parser(
        "tune", help="tune an op ahead of time for a sweep of shapes and save the configs",
        description="Run each shape once through the tuned kernels so that their configs are timed and saved to "
                    "the tuning cache (see `tilegemm info`); later calls and processes then tune nothing.",
    )
    p.add_argument("--op", default="matmul", help="the op to tune (default matmul)")
    p.add_argument("--dtype", help="input dtype (default: the op's first, fp16 for matmul)")
    p.add_argument("--sweep", help="one of the op's sweeps (default: llm for matmul)")
    p.add_argument("--shape", action="append", default=[], metavar="SHAPE", help="a shape (repeatable)")
    p.add_argument("--kernels", "--rungs", default="auto",
                   help="'auto' (default: the kernel auto picks per shape), or comma-separated tuned kernels "
                        "(matmul: autotuned, persistent_tma, split_k, gluon_f16, gluon_fp8, gluon_tf32)")


def _add_warmup(sub) -> None:
    p = sub.add_parser(
        "warmup", help="compile the kernels of every shipped or tuned shape class ahead of time",
        description="Call each kernel that has a config for this GPU once, on its shape class, so Triton compiles "
                    "it into its disk cache; a later process's first call on such a shape then compiles nothing.",
    )
    p.add_argument("--op", default="matmul", help="the op to warm up (default matmul)")
    p.add_argument("--shape", action="append", default=[], metavar="SHAPE",
                   help="instead, compile what auto picks for this shape (repeatable; matmul: M,N,K)")
    p.add_argument("--dtype", help="with --shape: the dtype (default fp16)")


def _add_puzzles(sub) -> None:
    p = sub.add_parser("puzzles", help="run the puzzle kernels under the interpreter against their specs",
                       description="Run the learning kit's puzzle kernels under Triton's interpreter, bounds-checked, "
                                   "on random sizes, against their plain-torch specs (tilegemm.learn.puzzles).")
    p.add_argument("--trials", type=int, default=3, help="random sizes per puzzle (default 3)")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; ``bench``'s option help lists the registered ops only when ``argv`` runs ``bench`` (or is
    None: the whole parser, as for documentation)."""
    parser = _Parser(prog="tilegemm", description="Triton GEMM-family kernels: benchmark, inspect, learn.")
    parser.add_argument("--version", action="version", version=f"tilegemm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_bench(sub, detailed=argv is None or "bench" in argv)
    _add_info(sub)
    _add_tune(sub)
    _add_warmup(sub)
    _add_puzzles(sub)
    return parser


def _version() -> str:
    """The installed distribution's version, read without importing the package (and torch)."""
    from importlib import metadata

    try:
        return metadata.version("tilegemm")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _help_only(argv: list[str]) -> bool:
    """Whether the command line only asks for help or the version, which need no registered op (all but
    ``bench --help``)."""
    return not argv or (("-h" in argv or "--help" in argv) and "bench" not in argv) or argv[0] == "--version"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if _help_only(args):
        parser = build_parser(args)
        try:
            parser.parse_args(args)  # prints the help asked for and exits 0
        except UsageError as err:
            print(f"tilegemm: error: {err}", file=sys.stderr)
            return 2
        parser.print_help()  # no command at all
        return 2
    for name in ("TILEGEMM_INTERPRET", "TRITON_INTERPRET"):  # read when tilegemm is imported: the user's to fix
        value = os.environ.get(name)
        if value is not None and value.strip().lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off",
                                                                ""):
            print(f"tilegemm: error: {name}={value!r}: expected 1 or 0 (or true/false, yes/no, on/off)",
                  file=sys.stderr)
            return 2
    from tilegemm.cli import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
