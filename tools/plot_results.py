"""Plot bench JSON files: python tools/plot_results.py RESULT.json [...] (writes RESULT.png beside each)."""

import json
import sys
from pathlib import Path

from tilegemm.bench.report import write_plot
from tilegemm.bench.runner import BenchResult


def main(paths: list[str]) -> None:
    for path in paths:
        result = BenchResult.from_dict(json.loads(Path(path).read_text()))
        out = Path(path).with_suffix(".png")
        write_plot(result, out, topk=6)
        print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
