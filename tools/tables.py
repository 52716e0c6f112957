"""The documentation's table of main-job results, written from the runs' own ``summary.json``.

    python -m tools.tables runs/ddp runs/fsdp1 runs/fsdp2 ... > docs/tables/main-job-engines.md

One row per run folder, in the order given: the config, its held-out losses (raw and each kept
average), the best post-hoc sigma_rel and its loss, the wall time, the tokens per second in
training steps and each average's shadow bytes on the rank holding the most.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(folder: Path) -> str:
    summary = json.loads((folder / "summary.json").read_text())
    heldout, sweep = summary["heldout"], summary.get("posthoc") or {}
    best = sweep.get("best")
    posthoc = f"{sweep['heldout'][str(best)]:.4f} ({best:g})" if best is not None else "-"
    shadows = {v for v in summary["shadow_bytes_per_rank"].values()}
    shadow = " / ".join(f"{v / 2**20:.2f} MiB" for v in sorted(shadows))
    return (
        f"| `{folder.name}.yaml` | {summary['processes']} | {heldout['raw']:.4f} | {heldout['ema']:.4f} | "
        f"{heldout['power']:.4f} | {posthoc} | {summary['wall_s']:.0f} s | {summary['tokens_per_s']:,} | {shadow} |"
    )


def main(folders: list[str]) -> None:
    print(
        "| config | processes | raw | EMA | power EMA | best post-hoc (sigma_rel) | wall time | tokens/s "
        "| shadow per rank, each average |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for folder in folders:
        print(row(Path(folder)))


if __name__ == "__main__":
    main(sys.argv[1:])
