"""Plot bench JSON files: python tools/plot_results.py RESULT.json [...] (writes RESULT.png beside each).

Reads plain or xz-compressed JSON (``RESULT.json.xz``, as the larger results are committed). A file it cannot
read, or one that is not a bench result, is named on one line and skipped; the exit status is 1 if any was, 2
without arguments."""

import json
import lzma
import sys
from pathlib import Path

from tilegemm.bench.report import write_plot
from tilegemm.bench.runner import BenchResult


def _result(path: str) -> BenchResult:
    xz = path.endswith(".xz")
    try:
        text = lzma.open(path, "rt").read() if xz else Path(path).read_text()
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, lzma.LZMAError, EOFError) as err:  # (EOFError: a truncated .xz)
        raise ValueError(f"cannot read it: {getattr(err, 'strerror', None) or err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError("not a bench result (a JSON object with 'rows', as `tilegemm bench --json` writes)")
    try:
        return BenchResult.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"not a bench result ({type(err).__name__}: {err})") from None


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    if paths[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    failed = 0
    for path in paths:
        try:
            result = _result(path)
        except ValueError as err:
            print(f"plot_results: {path}: {err}", file=sys.stderr)
            failed += 1
            continue
        out = Path(path.removesuffix(".xz")).with_suffix(".png")
        try:
            write_plot(result, out, topk=6)
        except (KeyError, TypeError, ValueError) as err:  # (rows without the fields a plot reads: meta.machine, ...)
            print(f"plot_results: {path}: not a complete bench result ({type(err).__name__}: {err})", file=sys.stderr)
            failed += 1
            continue
        print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
