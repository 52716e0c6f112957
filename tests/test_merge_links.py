"""Every reader of ``shardavg merge`` behind the one link confinement check (``base.links``): for each kind
of input (DCP, torchtitan, Hugging Face, an averager's save, DeepSpeed raw ZeRO-2 and ZeRO-3 tags, universal
checkpoints of both, Megatron-Core ``torch_dist``, a run folder's step folders), each file its reader opens
is moved out of the input and linked back in: ``shardavg merge A B --out OUT`` is refused in one line naming
the link, where it leads and the input, and OUT is not written. Links that stay within their input (and a
snapshot's links into the Hugging Face cache's blobs) are followed: the merge equals the one of plain files.
The inputs are built by the other merge tests' builders."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Trainer
from harness import TiedNet
from helpers import trained
from test_merge import Refusals, read_model
from test_merge_dcp_output import torchtitan_save, weights
from test_merge_deepspeed import masters, save_raw, save_universal, save_universal_zero3
from test_merge_hostile import hub_snapshot
from test_merge_hostile import model as hf_model
from test_merge_megatron import megatron_save
from test_merge_megatron import model as megatron_model

import shardavg


def averager_save(folder: Path, seed: int) -> None:
    torch.manual_seed(seed)
    trained(Trainer(TiedNet()), steps=2).save(folder)


def averager_saves(folder: Path, seed: int) -> None:
    """A folder of an averager's saves: its newest ``step-*`` is the input."""
    averager_save(folder / f"step-{seed:08d}", seed)


def dcp_run(folder: Path, seed: int) -> None:
    """A run folder of DCP saves (``step-1``, ``step-2``), merged with ``--last 2``."""
    for step in (1, 2):
        dcp.save(weights(seed + step), checkpoint_id=str(folder / f"step-{step}"), no_dist=True)


BUILDERS: dict[str, tuple[Callable[[Path, int], object], list[str]]] = {  # kind: (build(folder, seed), merge's options)
    "dcp": (lambda folder, seed: dcp.save(weights(seed), checkpoint_id=str(folder), no_dist=True), []),
    "torchtitan": (torchtitan_save, []),
    "hugging face": (hf_model, []),
    "averager": (averager_save, []),
    "averager saves": (averager_saves, []),
    "deepspeed zero-2": (lambda folder, seed: save_raw(folder, 2, masters(seed), torch.full((2,), float(seed))), []),
    "deepspeed zero-3": (lambda folder, seed: save_raw(folder, 3, masters(seed), torch.full((2,), float(seed))), []),
    "universal": (lambda folder, seed: save_universal(folder, masters(seed), folder.parent / "unpickled"), []),
    "universal zero-3": (lambda folder, seed: save_universal_zero3(folder, masters(seed), torch.ones(2)), []),
    "megatron": (  # (its carried files are copied into a DCP merge)
        lambda folder, seed: megatron_save(folder, megatron_model(seed), folder.parent / "unpickled", tp=1),
        ["--format", "dcp"],
    ),
    "run folder": (dcp_run, ["--last", "2"]),
}

PLANTED = [  # (kind, a file or folder its reader opens, relative to the input)
    ("dcp", ".metadata"),
    ("dcp", "__0_0.distcp"),
    ("torchtitan", ".metadata"),
    ("torchtitan", "__0_0.distcp"),
    ("hugging face", "model.safetensors"),
    ("hugging face", "config.json"),
    ("averager", "shardavg.json"),
    ("averager", "rank-00000-of-00001.safetensors"),
    ("averager saves", "step-00000002"),
    ("deepspeed zero-2", "mp_rank_00_model_states.pt"),
    ("deepspeed zero-2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("deepspeed zero-3", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ("deepspeed zero-3", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("universal", "zero/fc1.weight/fp32.pt"),
    ("universal", "zero/fc1.weight"),
    ("universal zero-3", "zero/fc2.bias/fp32.pt"),
    ("universal zero-3", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ("megatron", "common.pt"),
    ("megatron", "metadata.json"),
    ("megatron", ".metadata"),
    ("megatron", "__0_0.distcp"),
    ("run folder", "step-2"),
]


def inputs(tmp_path: Path, kind: str) -> tuple[list[Path], list[str]]:
    """The inputs of a merge of ``kind`` (A, then B, the newest; a run folder alone) and its options."""
    build, options = BUILDERS[kind]
    name = "iter_{:07d}" if kind == "megatron" else "global_step{}"  # (names every reader takes)
    seeds = (2,) if kind == "run folder" else (1, 2)
    for seed in seeds:
        build(tmp_path / "in" / name.format(seed), seed)
    return [tmp_path / "in" / name.format(seed) for seed in seeds], options


def move_out(file: Path, outside: Path) -> Path:
    """``file`` (or folder) moved to ``outside`` and linked back in its place: its reader would find the
    same bytes through the link."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(file, outside)
    file.symlink_to(outside)
    return outside


@pytest.mark.parametrize("kind, planted", PLANTED, ids=[f"{kind}:{planted}" for kind, planted in PLANTED])
def test_a_link_out_of_any_input_is_refused_by_name_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture, kind: str, planted: str
) -> None:
    folders, options = inputs(tmp_path, kind)
    link = folders[-1] / planted
    real = move_out(link, tmp_path / "elsewhere" / link.name)
    if link.name == "fc1.weight":  # (a folder linked out: the file read in it is named, and where it really lies)
        link, real = link / "fp32.pt", real / "fp32.pt"
    args = [*options, *map(str, folders), "--out", str(tmp_path / "out")]  # (``--last 2 RUN``)
    Refusals(capsys)(*args, match=f"{link} links to {real}, outside {folders[-1]}")
    assert not (tmp_path / "out").exists() and not (tmp_path / "in" / "unpickled").exists()


def move_in(file: Path, within: Path) -> None:
    """``file`` (or folder) moved to ``within`` (in its own input) and linked back by a relative link."""
    within.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(file, within)
    file.symlink_to(os.path.relpath(within, file.parent))


@pytest.mark.parametrize(
    "kind, planted",
    [
        ("dcp", "__0_0.distcp"),
        ("torchtitan", ".metadata"),
        ("deepspeed zero-3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("universal", "zero/fc1.weight"),
        ("universal zero-3", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ],
)
def test_a_link_that_stays_within_its_input_is_followed(tmp_path: Path, kind: str, planted: str) -> None:
    folders, _ = inputs(tmp_path, kind)
    want = read_model(shardavg.merge(folders, tmp_path / "plain"))
    move_in(folders[-1] / planted, folders[-1] / "kept" / Path(planted).name)
    assert (folders[-1] / planted).is_symlink()
    got = read_model(shardavg.merge(folders, tmp_path / "linked"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[name], want[name]) for name in want)


def test_a_hub_snapshot_and_a_linked_input_are_read_and_an_averagers_files_are_never_links(tmp_path: Path) -> None:
    """The input named may be a link (the user chose it), a hub snapshot's files link into its
    repository's blobs; an averager's save holds no link, even one within it (its files are opened
    through the save's folder: shardavg writes none)."""
    snapshot = hub_snapshot(tmp_path / "hub", hf_model(tmp_path / "a", 0))
    named = tmp_path / "named"
    named.symlink_to(hf_model(tmp_path / "b", 1))
    assert read_model(shardavg.merge([snapshot, named], tmp_path / "out")).keys() == {"embed.weight", "norm.weight"}

    save = tmp_path / "save"
    averager_save(save, 0)
    (tmp_path / "linked").symlink_to(save)
    assert read_model(shardavg.merge([tmp_path / "linked"], tmp_path / "average"))
    shard = save / "rank-00000-of-00001.safetensors"
    shard.rename(save / "kept.safetensors")
    shard.symlink_to("kept.safetensors")
    with pytest.raises(shardavg.CheckpointError, match=f"{shard} links to {save / 'kept.safetensors'}: a save's files"):
        shardavg.merge([save], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_an_out_that_is_a_link_is_refused_saying_where_it_points_and_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """OUT a link to an empty folder: ``merge --out``, ``export`` and an averager's ``save`` are each
    refused in one line saying that it is a link, where it points and the real folder to pass (a save
    would replace the link, not fill the folder); nothing is written there, and that folder works."""
    folders, _ = inputs(tmp_path, "dcp")
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "out"
    link.symlink_to(real)
    said = f"{link} is a symbolic link to {real.resolve()}: shardavg does not write through a link; pass the real "
    said += f"folder, {real.resolve()}, instead"
    Refusals(capsys)(*map(str, folders), "--out", str(link), match=said)

    averager = trained(Trainer(TiedNet()), steps=2)
    averager.save(tmp_path / "save")
    capsys.readouterr()
    assert shardavg.cli.main(["export", str(tmp_path / "save"), str(link)]) == 2
    assert capsys.readouterr().err == f"shardavg: error: {said}\n"
    with pytest.raises(shardavg.CheckpointError, match=re.escape(said)):
        averager.save(link)
    assert os.listdir(real) == [] and link.is_symlink()

    (tmp_path / "notes").write_text("mine")
    (tmp_path / "to-a-file").symlink_to(tmp_path / "notes")
    Refusals(capsys)(*map(str, folders), "--out", str(tmp_path / "to-a-file"), match="; name a folder instead")
    assert read_model(shardavg.merge(folders, real)).keys()
