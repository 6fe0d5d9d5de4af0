"""Offline: do the survey's ranking constants, fitted on the 16-bit tables, suit the tf32 and fp8 tables too?
(not a test; no GPU)

For each of the tf32 and fp8 surveys (H200 and H100), the leave-one-out score of ``tools/fit_survey.py --check``
(each surveyed shape chosen from the other shapes' data, cuBLAS / the chosen candidate's time, geomean) over
1, 2, 3 or 5 neighbours (``survey.NEIGHBOURS``) and utilization weights 0, 0.5 and 1 (``survey.WAVE_WEIGHT``).

    python3 research/explore_survey_families.py
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "src"))

import fit_survey  # noqa: E402
from tilegemm.ops.matmul import survey  # noqa: E402

RES = ROOT / "benchmarks" / "results"
SURVEYS = {
    "H200 tf32": RES / "2026-11-24-h200/b8567e0/survey-tf32-s7-0.json.xz",
    "H200 fp8": RES / "2026-11-24-h200/b8567e0/survey-fp8_e4m3-s7-NT-0.json.xz",
    "H100 tf32": RES / "2026-11-24-h100/521cce8/survey-tf32-s7-0.json.xz",
    "H100 fp8": RES / "2026-11-24-h100/521cce8/survey-fp8_e4m3-s7-NT-0.json.xz",
}


def main() -> None:
    for name, path in SURVEYS.items():
        gpu, layout, dtype, rows = fit_survey.load([str(path)])
        doc = fit_survey.table(gpu, [], rows, layout, dtype)
        scores = []
        for neighbours in (1, 2, 3, 5):
            for weight in (0.0, 0.5, 1.0):
                survey.NEIGHBOURS, survey.WAVE_WEIGHT = neighbours, weight
                text = io.StringIO()
                with contextlib.redirect_stdout(text):
                    fit_survey.check(doc, rows, fit_survey.read(str(path))["machine"]["sm_count"])
                score = text.getvalue().split("leave-one-out choice ")[1].split(" ")[0]
                scores.append(f"n{neighbours} w{weight}: {score}")
        print(f"{name:10s} " + "  ".join(scores))


if __name__ == "__main__":
    main()
