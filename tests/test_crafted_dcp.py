"""Crafted DCP ``.metadata`` files (issue 46, items 4 and 7): a chunk table that lists one box
millions of times, repeats a box or overlaps is refused before any chunk is looked for, and a
pickle nested deeper than ``PICKLE_DEPTH`` (a tuple key 200,000 deep kills the unpickler with
SIGSEGV) before anything is unpickled; each in one line naming the file and the tensor. The
files are written through torch's own DCP classes and ``pickle``, as a user's would be."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from shardavg import CheckpointError
from shardavg.base.untrusted import check_pickle
from shardavg.offline import saved_average
from shardavg.offline.saved_average import DcpFolder, read_dcp_metadata

KEY = "model.w"


def saved(folder: Path, edit: Callable | None = None, protocol: int = pickle.DEFAULT_PROTOCOL) -> Path:
    """A DCP checkpoint of two tensors, its metadata changed by ``edit(metadata)`` (None: as saved)."""
    with warnings.catch_warnings():  # (DCP warns that it saves in one process)
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(64.0).view(8, 8), "b": torch.ones(3)}}, checkpoint_id=str(folder))
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # noqa: S301 - written just above by dcp.save
    if edit is not None:
        edit(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=protocol))
    return folder


def located(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The chunks ``DcpFolder.location`` is asked for, from now on."""
    asked: list[object] = []
    original = DcpFolder.location

    def counting(self: DcpFolder, fqn: str, offset: object, limit: int) -> tuple[Path, int, int]:
        asked.append(offset)
        return original(self, fqn, offset, limit)

    monkeypatch.setattr(DcpFolder, "location", counting)
    return asked


def chunks(*boxes: tuple[tuple[int, int], tuple[int, int]]) -> Callable:
    def edit(metadata: object) -> None:
        metadata.state_dict_metadata[KEY].chunks[:] = [  # type: ignore[attr-defined]
            ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes
        ]

    return edit


def repeated(times: int) -> Callable:
    def edit(metadata: object) -> None:
        table = metadata.state_dict_metadata[KEY].chunks  # type: ignore[attr-defined]
        table[:] = [table[0]] * times  # one object: pickled once, referenced ``times`` times (2 bytes each)

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (repeated(200_000), r"'model.w' lists 200000 chunks, but the checkpoint stores only 2 items, one per chunk"),
        (repeated(2), r"'model.w' lists two chunks at offsets \[0, 0\]: a chunk table that repeats a box cannot"),
        (chunks(((0, 0), (8, 8)), ((1, 1), (2, 2))), r"the chunks of 'model.w' .* do not tile its shape \[8, 8\]"),
    ],
    ids=["a box listed 200,000 times", "a box listed twice", "overlapping boxes"],
)
def test_a_chunk_table_that_cannot_tile_is_refused_before_any_chunk_is_located(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: Callable, message: str
) -> None:
    folder = DcpFolder(saved(tmp_path / "dcp", edit))
    asked = located(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'dcp' / '.metadata'}: {message}") as refused:
        folder.read(KEY)
    assert "\n" not in str(refused.value)
    assert asked == [], "a chunk was looked for before the table was checked"
    assert torch.equal(folder.read("model.b"), torch.ones(3))  # (the other tensor's table is whole)


def test_more_chunks_than_offsets_in_the_shape_are_refused_by_their_count(tmp_path: Path) -> None:
    """A table longer than the places a box can start in its tensor is refused by its length alone,
    whatever the checkpoint stores: (8 + 1) * (8 + 1) = 81 offsets for a tensor of 8 x 8."""

    def padded(metadata: object) -> None:
        repeated(82)(metadata)
        stored = metadata.storage_data  # type: ignore[attr-defined]
        first = next(iter(stored.values()))
        stored.update({f"filler-{i}": first for i in range(100)})  # (more items than chunks)

    folder = DcpFolder(saved(tmp_path / "dcp", padded))
    with pytest.raises(CheckpointError, match=r"'model.w' lists 82 chunks, but its shape \[8, 8\] has only 81 offsets"):
        folder.boxes(KEY, (8, 8), torch.float32)


def placeholder_key(metadata: object) -> None:
    """A second entry for the tensor, under a key the test replaces in the pickle's bytes (Python
    cannot pickle a key nested 200,000 deep, nor hash one)."""
    entries = metadata.state_dict_metadata  # type: ignore[attr-defined]
    entries["PLACEHOLDER-KEY"] = entries[KEY]


def test_a_key_nested_200000_deep_is_refused_before_anything_is_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unpickled, the key kills the process (SIGSEGV hashing it): the unpickler must never see it."""
    folder = saved(tmp_path / "dcp", placeholder_key, protocol=2)  # (no frames: the bytes can be replaced)
    raw = (folder / ".metadata").read_bytes()
    placeholder = b"X" + len("PLACEHOLDER-KEY").to_bytes(4, "little") + b"PLACEHOLDER-KEY"  # BINUNICODE
    assert raw.count(placeholder) == 1
    (folder / ".metadata").write_bytes(raw.replace(placeholder, b")" + b"\x85" * 200_000))  # EMPTY_TUPLE, TUPLE1...

    def never(self: object) -> None:
        raise AssertionError("the nested pickle reached the unpickler")

    monkeypatch.setattr(saved_average._MetadataUnpickler, "load", never)
    with pytest.raises(CheckpointError) as refused:
        read_dcp_metadata(folder)
    assert str(refused.value) == (
        f"{folder / '.metadata'}: a pickle nested more than 100 levels deep (PICKLE_DEPTH), deeper than any "
        "checkpoint's files go (damaged or crafted): refused"
    )


def test_a_pickle_is_walked_in_every_protocol_bounded_in_objects_and_must_be_whole(tmp_path: Path) -> None:
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):  # an honest checkpoint reads, however pickled
        folder = DcpFolder(saved(tmp_path / f"p{protocol}", protocol=protocol))
        assert torch.equal(folder.read(KEY), torch.arange(64.0).view(8, 8)), protocol
    honest = pickle.dumps({"a": [1, (2, 3), {4}, frozenset({5})], "b": b"x" * 300, "c": 1.5, "d": 10**30})
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # (protocol 0's text opcodes too)
        check_pickle(pickle.dumps(pickle.loads(honest), protocol=protocol), "p")  # noqa: S301 - our own
    with pytest.raises(CheckpointError, match=r"^many builds more than 100 objects and entries \(PICKLE_OBJECTS\)"):
        check_pickle(pickle.dumps(list(range(1000))), "many", objects=100)
    for broken in (b"", honest[:-5], b"\xff.", b"\x80\x02a."):  # empty, truncated, no opcode, nothing to append to
        with pytest.raises(CheckpointError, match=r"^cannot read broken: not a pickle \(truncated or damaged\)$"):
            check_pickle(broken, "broken")
