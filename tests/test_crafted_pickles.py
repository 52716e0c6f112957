"""Crafted pickles (issue 59, item 3): what a few bytes added to an honest DCP ``.metadata`` make
the unpickler pay, refused by ``check_pickle`` before the unpickler sees them, in one line naming
the file. A memo slot stored far past the others (the unpickler allocates a table of twice its
number: slot 2**27 took ``shardavg merge`` to 2.3 GB), one fetched that was never stored,
containers nested a million deep by adding to them through the memo after they were put inside
another (each looked two levels deep), a cycle, and shared tuples whose hash visits 2**40 of them.
Honest metadata, as ``dcp.save`` writes it, still reads, at about the cost it always had. The
crafted bytes are pickle's own opcodes, written out."""

from __future__ import annotations

import pickle
import pickletools
import re
import struct
import time
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import shardavg.cli
from shardavg import CheckpointError
from shardavg.base.untrusted import check_pickle
from shardavg.offline.saved_average import check_dcp

ADDED = (
    "a pickle that adds to a container after putting it inside another (a cycle, or nesting hidden behind the memo), "
    "which no checkpoint's metadata does (damaged or crafted): refused"
)
NOT_A_PICKLE = "not a pickle (truncated or damaged)"


def saved_model(folder: Path) -> Path:
    """A small model and its optimizer's state saved by ``dcp.save``, as a training run saves them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():  # (DCP warns that it saves in one process)
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=str(folder))
    return folder


def stored(raw: bytes) -> int:
    """How many memo slots the pickle ``raw`` stores: the next one it would store."""
    return sum(1 for op, _, _ in pickletools.genops(raw) if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"))


def added(metadata: Path, opcodes: Callable[[int], bytes]) -> None:
    """``opcodes(slots it has stored)`` added to the pickled ``metadata`` before its STOP, leaving its
    stack as it was: the unpickler runs them and returns the same metadata."""
    raw = metadata.read_bytes()
    assert raw.endswith(pickle.STOP)
    metadata.write_bytes(raw[:-1] + opcodes(stored(raw)) + pickle.STOP)


def get(slot: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", slot)


def memo_slot(slot: int) -> Callable[[int], bytes]:
    """LONG_BINPUT at ``slot``: five bytes, whatever the pickle has stored."""
    return lambda _: pickle.LONG_BINPUT + struct.pack("<I", slot)


def test_a_memo_slot_stored_far_past_the_others_is_refused_fast_at_the_honest_inputs_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The issue's case: ``shardavg merge`` of an honest checkpoint and one whose ``.metadata`` stores
    memo slot 2**27 exited 0 after 1.5 s at 2 GB more than the honest merge (traced: its unpickler's
    memo table). Now it is refused in milliseconds, having allocated less than the honest merge."""
    honest, other, crafted = (saved_model(tmp_path / name) for name in ("honest", "other", "crafted"))
    added(crafted / ".metadata", memo_slot(2**27))

    def merge(*inputs: Path) -> tuple[int, float, int]:
        """The exit status, seconds and peak of traced memory of ``shardavg merge INPUTS``."""
        tracemalloc.start()
        start = time.perf_counter()
        try:
            code = shardavg.cli.main(["merge", *map(str, inputs), "--out", str(tmp_path / f"out-{inputs[-1].name}")])
            return code, time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    code, _, honest_peak = merge(honest, other)
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    code, seconds, crafted_peak = merge(honest, crafted)
    assert code == 2
    assert capsys.readouterr().err == (
        f"shardavg: error: {crafted / '.metadata'}: a pickle that stores memo slot 134217728 after storing "
        f"{stored((honest / '.metadata').read_bytes())} (pickle stores slots 0, 1, 2... in turn; the unpickler "
        "would allocate 268,435,456 slots of 8 bytes for it) (damaged or crafted): refused\n"
    )
    assert seconds < 1.0, f"refused after {seconds:.2f} s"
    mib = f"{crafted_peak / 2**20:.2f} MiB traced, the honest merge {honest_peak / 2**20:.2f}"
    assert crafted_peak <= honest_peak, mib
    assert not (tmp_path / "out-crafted").exists()


@pytest.mark.parametrize(
    "crafted, slot, before, honest",
    [
        (b"(lp134217728\n.", 134217728, 0, b"(lp0\n."),  # protocol 0: MARK LIST PUT, in decimal
        (b"\x80\x02]q\x05.", 5, 0, b"\x80\x02]q\x00."),  # EMPTY_LIST BINPUT: a byte's worth past
        (b"\x80\x02]q\x00]r\x00\x00\x00@.", 2**30, 1, b"\x80\x02]q\x00]r\x01\x00\x00\x00."),  # LONG_BINPUT
        (b"\x80\x04]\x94]\x94]q\x03.", 3, 2, b"\x80\x04]\x94]\x94]q\x00."),  # one past MEMOIZE's; slot 0 again
    ],
    ids=["PUT", "BINPUT", "LONG_BINPUT", "after MEMOIZE"],
)
def test_every_memo_store_is_bounded_by_the_slots_stored_before_it(
    crafted: bytes, slot: int, before: int, honest: bytes
) -> None:
    """Refused past the next slot; the next slot, or one stored again, is what pickle writes."""
    with pytest.raises(CheckpointError) as refused:
        check_pickle(crafted, "p")
    assert re.fullmatch(
        rf"p: a pickle that stores memo slot {slot} after storing {before} \(pickle stores slots 0, 1, 2\.\.\. in "
        rf"turn; the unpickler would allocate {2 * slot:,} slots of 8 bytes for it\) \(damaged or crafted\): refused",
        str(refused.value),
    )
    check_pickle(honest, "p")
    pickle.loads(honest)  # noqa: S301 - our own


@pytest.mark.parametrize(
    "raw",
    [b"(lg0\n.", b"\x80\x02]h\x00.", b"\x80\x02]q\x00h\x01.", b"\x80\x04]\x94j\x00\x00\x00\x08.", b"(lp0\ng-1\n."],
    ids=["GET", "BINGET", "BINGET past the one stored", "LONG_BINGET 2**27", "GET -1"],
)
def test_a_memo_slot_fetched_that_was_never_stored_is_not_a_pickle(raw: bytes) -> None:
    with pytest.raises(CheckpointError, match=rf"^cannot read p: {re.escape(NOT_A_PICKLE)}$"):
        check_pickle(raw, "p")
    with pytest.raises((KeyError, pickle.UnpicklingError)):  # (the unpickler agrees)
        pickle.loads(raw)  # noqa: S301 - refused either way


# Each adds a new container to the one fetched from the memo (which is inside the one before it),
# and puts the new one in the memo for the next: (the new one, its opcodes around it, one level down).
NS = pickle.GLOBAL + b"types\nSimpleNamespace\n" + pickle.EMPTY_TUPLE + pickle.NEWOBJ
KEY = pickle.BININT1 + b"\x00"
ADDERS: dict[str, tuple[bytes, Callable[[bytes], bytes], Callable[[object], object]]] = {
    "APPEND": (pickle.EMPTY_LIST, lambda new: new + pickle.MEMOIZE + pickle.APPEND, lambda x: x[0] if x else None),
    "APPENDS": (
        pickle.EMPTY_LIST,
        lambda new: pickle.MARK + new + pickle.MEMOIZE + pickle.APPENDS,
        lambda x: x[0] if x else None,
    ),
    "SETITEM": (pickle.EMPTY_DICT, lambda new: KEY + new + pickle.MEMOIZE + pickle.SETITEM, lambda x: x.get(0)),
    "SETITEMS": (
        pickle.EMPTY_DICT,
        lambda new: pickle.MARK + KEY + new + pickle.MEMOIZE + pickle.SETITEMS,
        lambda x: x.get(0),
    ),
    "BUILD": (  # an object's state: {"x": the new object}
        NS,
        lambda new: pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x01x" + new + pickle.MEMOIZE + pickle.SETITEM
        + pickle.BUILD,
        lambda x: getattr(x, "x", None),
    ),
}  # fmt: skip


def chained(adder: str, depth: int, first: int = 0) -> bytes:
    """Opcodes nesting ``depth`` containers in the one they push, each added to the last through
    the memo; ``first``: the memo slot they start storing at. Each looks two levels deep."""
    new, add, _ = ADDERS[adder]
    return new + pickle.MEMOIZE + b"".join(get(first + i) + add(new) + pickle.POP for i in range(depth))


@pytest.mark.parametrize("adder", list(ADDERS))
def test_nesting_hidden_behind_the_memo_is_refused(adder: str) -> None:
    """Through every opcode that adds to a container, what the unpickler builds is as deep as the
    chain is long (here 10,000 deep, a hundred times ``PICKLE_DEPTH``), and refused at its second link."""
    raw = pickle.PROTO + b"\x04" + chained(adder, 10_000) + pickle.STOP
    with pytest.raises(CheckpointError, match=rf"^p: {re.escape(ADDED)}$"):
        check_pickle(raw, "p")
    levels, item, down = 0, pickle.loads(raw), ADDERS[adder][2]  # noqa: S301 - ours, of lists, dicts and namespaces
    while item is not None:
        item, levels = down(item), levels + 1
    assert levels == 10_001


def test_lists_nested_a_million_deep_through_the_memo_are_refused_by_the_dcp_reader(tmp_path: Path) -> None:
    """The issue's case, 9 MB added to an honest ``.metadata``: refused in well under a second."""
    folder = saved_model(tmp_path / "dcp")
    added(folder / ".metadata", lambda slots: chained("APPEND", 1_000_000, slots) + pickle.POP)
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as refused:
        check_dcp(folder)
    assert time.perf_counter() - start < 1.0
    assert str(refused.value) == f"{folder / '.metadata'}: {ADDED}"


def test_a_cycle_is_refused_as_nested_without_end() -> None:
    """Pickle writes cycles (a list that holds itself), but a checkpoint's metadata never holds one."""
    looped: list[object] = []
    looped.append(looped)
    within: dict[str, object] = {"list": [1]}
    within["list"].append(within)  # type: ignore[union-attr]
    for cycle in (looped, within, (within,)):
        for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):
            with pytest.raises(CheckpointError, match=rf"^p: {re.escape(ADDED)}$"):
                check_pickle(pickle.dumps(cycle, protocol=protocol), "p")


def test_shared_tuples_a_hash_would_walk_2_to_the_40_times_are_refused() -> None:
    """A tuple of one tuple twice, 40 times over, as a dict key: 200 bytes that the unpickler would
    hash for hours, visiting 2**40 tuples (2**24 took 0.2 s). Counted as a walk visits them."""
    levels = pickle.BININT1 + b"\x01" + pickle.TUPLE1 + pickle.MEMOIZE
    levels += b"".join(pickle.BINGET + bytes([i]) + pickle.TUPLE2 + pickle.MEMOIZE for i in range(40))
    raw = pickle.PROTO + b"\x04" + pickle.EMPTY_DICT + levels + pickle.BININT1 + b"\x01" + pickle.SETITEM + pickle.STOP
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as refused:
        check_pickle(raw, "p")
    assert time.perf_counter() - start < 1.0
    assert str(refused.value) == (
        f"p builds more than {2**26} objects and entries (PICKLE_OBJECTS), counting a shared one each time it "
        "is held, more than any checkpoint's metadata"
    )
    shared = pickle.dumps([(1, 2)] * 1000)  # one tuple of two held 1000 times: 3,001 objects and entries walked
    check_pickle(shared, "p", objects=3001)
    with pytest.raises(CheckpointError, match=r"^p builds more than 3000 objects and entries"):
        check_pickle(shared, "p", objects=3000)


def large_honest_metadata(tensors: int, ranks: int) -> bytes:
    """DCP's metadata of ``tensors`` tensors, each saved in ``ranks`` chunks (FSDP's layout), built of
    DCP's classes and pickled as ``dcp.save`` does: 0.6 MB here, 23 MB for 20,000 tensors."""
    entries, storage = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.mlp.weight"
        chunks = [ChunkStorageMetadata(torch.Size([8 * r, 0]), torch.Size([8, 64])) for r in range(ranks)]
        entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8 * ranks, 64]), chunks)
        for r, chunk in enumerate(chunks):
            storage[MetadataIndex(fqn, torch.Size(chunk.offsets), r)] = _StorageInfo(f"__{r}_0.distcp", 2048 * t, 2048)
    return pickle.dumps(Metadata(entries, None, storage))


def test_honest_metadata_reads_in_every_protocol_and_its_check_costs_a_few_unpicklings(tmp_path: Path) -> None:
    folder = saved_model(tmp_path / "dcp")
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # noqa: S301 - written just above by dcp.save
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):  # (0 and 1 need copyreg, which is refused)
        (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=protocol))
        assert check_dcp(folder).state_dict_metadata.keys() == metadata.state_dict_metadata.keys(), protocol
    raw = large_honest_metadata(500, 8)  # (600 KB; the check takes about three times unpickling's time)
    checked, unpickled = [], []
    for _ in range(3):
        start = time.process_time()
        check_pickle(raw, "p")
        checked.append(time.process_time() - start)
        start = time.process_time()
        pickle.loads(raw)  # noqa: S301 - our own
        unpickled.append(time.process_time() - start)
    assert min(checked) < 10 * min(unpickled), f"checked in {min(checked):.3f} s, unpickled in {min(unpickled):.3f}"


def test_attributes_set_on_torchs_own_enum_members_are_put_back_and_refused(tmp_path: Path) -> None:
    """``WriteItemType(1)`` hands back the process's own member; a ``BUILD`` after it would set an
    attribute on it for every later user of DCP in the process."""
    from torch.distributed.checkpoint.planner import WriteItemType

    before = dict(vars(WriteItemType.TENSOR))
    crafted = (
        b"\x80\x02ctorch.distributed.checkpoint.planner\nWriteItemType\nK\x01\x85R"  # WriteItemType(1)
        b"}X\x05\x00\x00\x00extraX\x01\x00\x00\x00Xsb."  # BUILD {"extra": "X"}
    )
    folder = saved_model(tmp_path / "ckpt")
    (folder / ".metadata").write_bytes(crafted)
    with pytest.raises(CheckpointError, match=r"sets attributes on torch's own \['WriteItemType.TENSOR'\] \(crafted\)"):
        check_dcp(folder)
    assert vars(WriteItemType.TENSOR) == before and not hasattr(WriteItemType.TENSOR, "extra")
