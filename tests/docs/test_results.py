"""benchmarks/results keeps the runs that the README and the docs cite, stays small, and RESULTS.md has a row for
every run: those in the tree, and those removed (pointing to the commit that holds them)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LIMIT_BYTES = 15 * 10**6
# A run cited with its day: `2026-11-24-h200/fbb89b0/`, `2026-11-25-{h200,h100}/f7d14e6/`, `2026-11-25-*/a4c9442/`.
FULL = re.compile(r"(20\d\d-\d\d-\d\d-(?:h100|h200|cpu|h\*|\*|\{[a-z0-9,]+\}))/([A-Za-z0-9_*{},-]+)/")
# A run cited by its commit alone (its day named nearby): `fbb89b0/`.
BARE = re.compile(r"(?<![\w/.-])([0-9a-f]{7})/")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _expand(pattern: str) -> list[str]:
    """``a-{x,y}`` -> [``a-x``, ``a-y``]; globs are left to fnmatch."""
    m = re.search(r"\{([^}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _runs() -> dict[str, set[str]]:
    """day -> its run directories, with "." for a day's top-level files."""
    runs = {}
    for day in RESULTS.iterdir():
        if day.is_dir():
            runs[day.name] = {p.name for p in day.iterdir() if p.is_dir()}
            if any(p.is_file() for p in day.iterdir()):
                runs[day.name].add(".")
    return runs


def _matches(runs, day_pattern: str, run_pattern: str) -> bool:
    return any(fnmatch.fnmatch(day, dp) and any(fnmatch.fnmatch(r, rp) for r in subs for rp in _expand(run_pattern))
               for dp in _expand(day_pattern) for day, subs in runs.items())


def test_every_cited_run_directory_exists():
    runs = _runs()
    every_run = set().union(*runs.values())
    missing = []
    for page in _pages():
        text = page.read_text()
        for m in FULL.finditer(text):
            if not _matches(runs, m.group(1), m.group(2)):
                missing.append(f"{page.relative_to(ROOT)}: {m.group(0)}")
        for m in BARE.finditer(text):
            if m.group(1) not in every_run and f"{m.group(1)}/ (removed" not in text:
                missing.append(f"{page.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "cited results directories missing from benchmarks/results:\n" + "\n".join(missing)


def test_every_linked_result_file_exists():
    broken = [f"{page.relative_to(ROOT)}: {m.group(1)}" for page in _pages()
              for m in re.finditer(r"\]\(([^)#\s]*benchmarks/results/[^)#\s]*)\)", page.read_text())
              if not (page.parent / m.group(1)).exists()]
    assert not broken, "links into benchmarks/results that lead nowhere:\n" + "\n".join(broken)


def test_the_shipped_survey_tables_sources_exist():
    """tools/fit_survey.py makes each table again from the runs it names."""
    sources = {src for table in (ROOT / "src" / "tilegemm" / "tuned").rglob("*.json")
               for src in re.findall(r'"(benchmarks/results/[^"]+)"', table.read_text())}
    assert sources, "no survey table names its sources"
    missing = sorted(src for src in sources if not (ROOT / src).exists())
    assert not missing, "survey sources missing from benchmarks/results: " + ", ".join(missing)


def test_results_stay_under_the_limit():
    size = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert size <= LIMIT_BYTES, f"benchmarks/results holds {size / 1e6:.1f} MB (at most {LIMIT_BYTES / 1e6:.0f} MB)"


def _rows() -> dict[str, dict[str, str]]:
    """day -> {run directory -> its RESULTS.md row(s)}, from each day's section's table."""
    rows: dict[str, dict[str, str]] = {}
    day = None
    for line in (RESULTS / "RESULTS.md").read_text().splitlines():
        if line.startswith("## "):
            day = line[3:].strip()
            rows.setdefault(day, {})
        elif day and line.startswith("| `"):
            for m in re.finditer(r"`([^`]*/)`", line.split("|")[1]):
                run = m.group(1).rstrip("/") or "."
                rows[day][run] = rows[day].get(run, "") + line
    return rows


def test_every_run_directory_has_a_row():
    rows = _rows()
    missing = [f"{day}/{run}" for day, subs in _runs().items() for run in sorted(subs) if run not in rows.get(day, {})]
    assert not missing, "run directories without a row in benchmarks/results/RESULTS.md: " + ", ".join(missing)


def test_rows_of_removed_runs_name_the_commit_holding_them():
    runs = _runs()
    bad = [f"{day}/{run}" for day, table in _rows().items() for run, row in table.items()
           if run not in runs.get(day, set()) and not re.search(rf"`{re.escape(run)}/` \(removed; at [0-9a-f]{{7}}\)", row)
           and "console only" not in row]
    assert not bad, "rows of runs not in the tree that do not name the commit holding them: " + ", ".join(bad)
