"""Plot bench JSON files: python tools/plot_results.py RESULT.json [...] (writes RESULT.png beside each).

Reads plain or xz-compressed JSON (``RESULT.json.xz``, as the larger results are committed)."""

import json
import lzma
import sys
from pathlib import Path

from tilegemm.bench.report import write_plot
from tilegemm.bench.runner import BenchResult


def main(paths: list[str]) -> None:
    for path in paths:
        xz = path.endswith(".xz")
        text = lzma.open(path, "rt").read() if xz else Path(path).read_text()
        result = BenchResult.from_dict(json.loads(text))
        out = Path(path.removesuffix(".xz")).with_suffix(".png")
        write_plot(result, out, topk=6)
        print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
