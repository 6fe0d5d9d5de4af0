# Appended to conftest.SM90 by the offline sm_90 compiles that read ptxas -v's report (this directory's and
# tests/w4a16/w4a16_kit.py's): compile_sm90 as conftest's, the report taken from the run of ptxas that Triton's
# compile makes anyway (it passes -v), so each kernel goes through ptxas once rather than twice.
import contextlib as _contextlib
import io as _io

from triton import knobs as _knobs

_compile_sm90_ptxas_again = compile_sm90  # noqa: F821 (conftest.SM90's)


def compile_sm90(kernel, sig, constexprs, attrs, num_warps, num_stages=None, gluon=True, **more):
    source = (GluonASTSource if gluon else ASTSource)(kernel, sig, constexprs, attrs)  # noqa: F821
    options = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    options.update(more)
    log = _io.StringIO()
    with _contextlib.redirect_stdout(log), _knobs.nvidia.scope():
        _knobs.nvidia.dump_ptxas_log = True  # Triton prints the report of its ptxas -v
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)  # noqa: F821
    info = log.getvalue()
    if "Compiling entry function" not in info:  # from Triton's cache (this run compiled it before): no ptxas ran
        return _compile_sm90_ptxas_again(kernel, sig, constexprs, attrs, num_warps, num_stages, gluon, **more)
    return compiled, compiled.asm["ptx"], info
