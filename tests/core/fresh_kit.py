"""Scripts run as ``python -c`` runs them in a fresh process, several at the cost of one torch import: one process
imports torch (seconds on CI's runner, which every script would spend again) and forks a child for each script in
turn, before anything of tilegemm or triton is imported or any setting of torch's is made. A script reaches nothing
of another's: each child exits when its script ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# The parent of the children: torch imported (and nothing it does not import itself), then one fork a script, each
# child's stdout and stderr into files of its own, its exit status as `python -c` would give it.
_SERVER = r"""
import json, os, sys, traceback
import torch  # noqa: F401
assert "triton" not in sys.modules and "tilegemm" not in sys.modules, "import torch imported triton or tilegemm"
results = {}
for name, (code, argv, out_path, err_path) in json.loads(sys.argv[1]).items():
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out_path), (2, err_path)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = ["-c", *argv]
        status = 0
        try:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    results[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(results))
"""


def run_fresh(scripts: dict, tmp_path, env: dict | None = None, timeout: int = 900) -> dict:
    """``{name: (returncode, stdout, stderr)}`` of each ``scripts[name]``: its source, or (source, argv), run as
    ``python -c source *argv`` would, in the environment ``env`` (this one's where None)."""
    plan = {}
    for i, (name, script) in enumerate(scripts.items()):
        code, argv = (script, []) if isinstance(script, str) else script
        plan[name] = (code, [str(a) for a in argv], str(tmp_path / f"fresh{i}.out"), str(tmp_path / f"fresh{i}.err"))
    done = subprocess.run([sys.executable, "-c", _SERVER, json.dumps(plan)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    read = lambda path: open(path).read() if os.path.exists(path) else ""  # noqa: E731
    return {name: (codes[name], read(out), read(err)) for name, (_, _, out, err) in plan.items()}
