"""Issue 47's verdict rows over repeated runs of ``tools.bench``, from the runs' own ``--json``.

    torchrun --nproc_per_node 2 -m tools.bench --config configs/bench.yaml --json run1.json ...
    python -m tools.bench_verdicts run1.json run2.json run3.json

Prints the verdict table of each run (``bench.verdict_table``: the update with a verdict, the
unchecked and checked updates and the peers, ms medians) and one table of the four target ratios
per case across the runs (each run's value, in order, and how many runs met the limit), beside
the verdict against a separate check-off averager and the A/A ratio of two identical unchecked
averagers in each run, so that a miss can be told from the noise of a shared machine and of where
an averager's buffers fall. Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tools import bench


def rows_of(path: Path) -> list[bench.Row]:
    """The rows a bench run wrote with ``--json``; a file that is not one is refused by name."""
    try:
        record = json.loads(path.read_text())
        return [bench.Row(**{**row, "timed": tuple(row.get("timed", (0, 0)))}) for row in record["rows"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(
            f"{path}: not the JSON of a tools.bench run ({type(error).__name__}: {error}); "
            "write one with `torchrun ... -m tools.bench --json FILE`"
        ) from None


def across(runs: list[list[bench.Row]]) -> str:
    """Markdown, one line per case: each target ratio in every run (in order) and the runs that met
    it, then each run's verdict against the separate check-off averager and its A/A ratio (``-`` for
    a run without it)."""
    metrics = [metric for metric, _ in bench.VERDICT_TARGETS]
    limits = dict(bench.VERDICT_TARGETS)
    header = " | ".join(f"{metric} (<= {limits[metric]:.2f})" for metric in metrics)
    lines = [
        f"| engine | shape | live | {header} | verdict / another averager's check off "
        "| A/A: check off again / check off |",
        "|---|---|---|" + "---|" * (len(metrics) + 2),
    ]
    figures_by_run = [
        {case: bench.verdict_figures(by_role) for case, by_role in bench.cases(rows).items()} for rows in runs
    ]
    for case in figures_by_run[0]:
        cells = []
        for metric in metrics:
            values = [figures[case][metric] for figures in figures_by_run if figures.get(case)]
            met = sum(value <= limits[metric] for value in values)
            cells.append(", ".join(f"{value:.3f}" for value in values) + f" ({met} of {len(values)} met)")
        shown = [figures[case] for figures in figures_by_run if figures.get(case)]
        cells.append(", ".join(f"{figure['verdict / another averager']:.3f}" for figure in shown))
        cells.append(", ".join(bench.aa_shown(figure["A/A"]) for figure in shown))
        lines.append(f"| {' | '.join(case)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_verdicts", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="the --json files of tools.bench runs, in order")
    paths = parser.parse_args(argv).runs
    runs = [rows_of(path) for path in paths]
    for path, rows in zip(paths, runs):
        print(f"{path}:\n\n{bench.verdict_table(rows)}\n")
    print(across(runs))


if __name__ == "__main__":
    main()
