"""The every-rank export where OUT is a node-local disk: each rank sees its own folder at one path."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from launcher import torchrun

pytestmark = pytest.mark.slow  # a torchrun launch: python -m pytest -m "not slow" leaves it out


def mount_namespaces() -> bool:
    """Whether this process may make a mount namespace and bind-mount in it (root, ``unshare``)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = ["unshare", "-m", "sh", "-c", "mount --make-rprivate / && mount --bind /tmp /mnt"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not mount_namespaces(), reason="needs a mount namespace (root) to give rank 1 a disk of its own")
def test_an_export_into_a_folder_the_ranks_do_not_share_is_refused_with_nothing_committed(tmp_path: Path) -> None:
    base, disk = tmp_path / "base", tmp_path / "disk-of-rank-1"
    base.mkdir()
    disk.mkdir()
    launch = torchrun("scenario_export_disks.py", 2, str(base), str(disk), timeout=300)
    assert launch.returncode == 0, launch.output[-20000:]
    (messages,) = launch.reports("DISKS")
    out = base / "model"
    unshared = (
        f"rank 1 does not share {out} with the committer (rank 0): each sees its own folder at that path "
        "(a node-local disk?); export into a folder on a file system every rank sees, or with writers=1"
    )
    assert messages["stale"] == (
        f"exporting to {out} failed: rank 1: ExportError: {out / '.model.safetensors.incomplete'} is not this "
        f"export's file (another export's leftover): {unshared}"
    )
    split_file = re.escape(f"{out}/.model-") + r"[0-9a-f]{12}-\d{5}-of-\d{5}" + re.escape(".safetensors.incomplete")
    assert re.fullmatch(
        re.escape(f"exporting to {out} failed: rank 1: ExportError: ")
        + split_file
        + re.escape(f" is not there to write into: {unshared}"),
        messages["missing"],
    ), messages["missing"]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "provenance.json"]  # rank 0's, at the end
    assert sorted(p.name for p in (disk / "model").iterdir()) == [".model.safetensors.incomplete"]
