"""Exports compared byte for byte with their export ids made alike.

Every export has an id of its own (in every file's metadata and the index's, and in a split
model's file names), so two exports of the same weights, by any number of writers or workers,
differ there and nowhere else."""

from __future__ import annotations

from pathlib import Path

from shardavg.output.model_folder import folder_export_id

PLACEHOLDER = "0" * 12


def alike(folder: Path) -> dict[str, bytes]:
    """Every file of the export in ``folder`` but its provenance (which records who wrote it), by
    name, its export id (checked to be one) replaced by a placeholder in names and bytes."""
    export_id = folder_export_id(folder)
    assert export_id is not None, f"{folder} carries no export id"
    return {
        p.name.replace(export_id, PLACEHOLDER): p.read_bytes().replace(export_id.encode(), PLACEHOLDER.encode())
        for p in sorted(folder.iterdir())
        if p.name != "provenance.json"
    }
