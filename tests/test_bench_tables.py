"""The bench's arithmetic, in one process: the bytes an update must move, the one-pass floor for
bf16 weights, the columns derived from the copy, the targets' verdicts and the training loop's
rows (counts and exact values, never wall time)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import statistics
from pathlib import Path

import pytest
import torch

pytest.importorskip("yaml", reason="PyYAML (the job's configs) is not installed (pip install -e '.[launch]')")
from launch import config as configs  # noqa: E402
from tools import bench, bench_verdicts, loop  # noqa: E402


class Stub:
    """What ``floor()`` needs of an engine: this rank's local shards."""

    def __init__(self, shards: list[torch.Tensor]) -> None:
        self.shards = shards

    def local_shards(self):
        return iter(self.shards)


@pytest.mark.parametrize(
    ("itemsize", "check", "averages", "per_element"),
    [(4, False, 1, 12), (4, True, 1, 16), (2, False, 1, 10), (2, True, 1, 12), (2, True, 3, 28), (4, True, 3, 32)],
)
def test_the_bytes_an_update_must_move(itemsize: int, check: bool, averages: int, per_element: int) -> None:
    assert bench.Shards(1000, itemsize).update_bytes(check, averages) == 1000 * per_element


def test_pieces_cover_every_element_once_in_batches_of_the_buffer() -> None:
    sizes = [5, 300, 7, 1, 64]
    shadows = [torch.zeros(n) for n in sizes]
    lives = [torch.arange(n, dtype=torch.bfloat16) for n in sizes]
    buffer = torch.empty(64)
    batches = bench.pieces(shadows, lives, buffer)
    assert [sum(v.numel() for v in batch[1]) for batch in batches] == [64] * 5 + [57]
    assert [len(batch[0]) for batch in batches] == [2, 1, 1, 1, 4, 1]  # 300 split over five, the small ones packed
    for shadow_views, live_views, buffer_views in batches:
        assert [v.numel() for v in live_views] == [v.numel() for v in shadow_views] == [v.numel() for v in buffer_views]
        assert all(v.data_ptr() >= buffer.data_ptr() for v in buffer_views)
    in_order = torch.cat([v for batch in batches for v in batch[1]])
    assert torch.equal(in_order, torch.cat(lives))
    assert sum(v.numel() for batch in batches for v in batch[0]) == sum(sizes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_one_pass_floor_is_bitwise_a_lerp_toward_the_weights_in_fp32(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    sizes = (1000, 3, 257, 4096)
    lives = [torch.randn(n).to(dtype) for n in sizes]
    shadows, want = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    update = bench.one_pass(shadows, lives, 1 - 0.999, piece=128)
    for _ in range(3):
        update()
        torch._foreach_lerp_(want, [live.float() for live in lives], 1 - 0.999)
    assert all(torch.equal(got, expected) for got, expected in zip(shadows, want))


def test_the_floor_counts_the_bytes_of_one_pass() -> None:
    lives = [torch.randn(n).to(torch.bfloat16) for n in (1000, 24)]
    method = bench.floor(Stub(lives), 0.999, bench.Shards(1024, 2), piece=128)
    assert (method.role, method.floor_bytes, method.extra_bytes()) == ("floor", 1024 * 10, 1024 * 4)


def rows_of_a_case(shape: str, ms: dict[str, float], peers: dict[str, float]) -> list[bench.Row]:
    shards = bench.Shards(1_000_000, 2)
    made = [
        ("ours", "ours", shards.update_bytes(True)),
        ("ours, check off", "ours", shards.update_bytes(False)),
        ("floor", "floor", shards.update_bytes(False)),
        ("copy floor", "copy", shards.update_bytes(False)),
        ("stream add floor", "copy", shards.update_bytes(False)),
    ]
    made += [(name, "peer", shards.update_bytes(False)) for name in peers]
    times = {**ms, **peers}
    return [bench.Row("fsdp2", shape, "bfloat16", name, role, times[name], times[name], 0, 0, "", floor_bytes=nbytes)
            for name, role, nbytes in made]  # fmt: skip


def test_the_columns_against_the_faster_stream() -> None:
    """10 MB in 1 ms (10 GB/s, the add; the copy's 5 GB/s left aside): the check-off update in
    2 ms is 2x its bytes floor, 0.5 of the memory's GB/s."""
    ms = {"ours": 3.0, "ours, check off": 2.0, "floor": 1.5, "copy floor": 2.0, "stream add floor": 1.0}
    rows = rows_of_a_case("transformer", ms, {})
    bench.against_memory(rows)
    by = {r.method: r for r in rows}
    assert by["stream add floor"].gb_per_s == pytest.approx(10.0) and by["stream add floor"].of_memory == 1.0
    assert by["copy floor"].gb_per_s == pytest.approx(5.0) and by["copy floor"].x_bytes_floor == pytest.approx(2.0)
    off, on = by["ours, check off"], by["ours"]
    assert (off.bytes_floor_ms, off.x_bytes_floor, off.gb_per_s, off.of_memory) == pytest.approx((1.0, 2.0, 5.0, 0.5))
    assert (on.bytes_floor_ms, on.x_bytes_floor, on.gb_per_s, on.of_memory) == pytest.approx((1.2, 2.5, 4.0, 0.4))
    on_gpu = {r["metric"]: r["verdict"] for r in bench.targets(rows, {}, "cuda") if not r["at_most"]}
    assert on_gpu == {"check on, of memory": "MISS", "check off, of memory": "MISS"}  # (0.4 and 0.5 of 0.8)


def test_the_targets_and_their_verdicts() -> None:
    ms = {"ours": 1.3, "ours, check off": 1.1, "floor": 1.0, "copy floor": 1.5, "stream add floor": 1.0}
    rows = rows_of_a_case("transformer", ms, {"torchtitan-style": 1.2, "hand-written fp32": 1.0})
    rows += rows_of_a_case("many_small", ms, {})
    for case in bench.cases(rows).values():
        bench.against_memory([r for role in case.values() for r in role])
    records = bench.targets(rows, {"transformer": "transformer", "many_small": "many_small"})
    assert all(r["at_most"] for r in records)
    got = {(r["shape"], r["metric"]): (round(r["value"], 6), r["limit"], r["verdict"]) for r in records}
    assert got == {
        ("transformer", "check off / bytes floor"): (1.1, 1.05, "MISS"),
        ("transformer", "check off / fastest peer"): (1.1, 1.0, "MISS"),
        ("transformer", "check on / check-off bytes floor"): (1.3, 1.35, "PASS"),
        ("transformer", "check on / fastest peer"): (1.3, 1.35, "PASS"),
        ("transformer", "check on / check off"): (round(1.3 / 1.1, 6), 1.35, "PASS"),
        ("many_small", "check off / bytes floor"): (1.1, 1.25, "PASS"),
        ("many_small", "check off / fastest peer"): (pytest.approx(float("nan"), nan_ok=True), 1.0, "MISS"),
        ("many_small", "check on / check-off bytes floor"): (1.3, 1.35, "PASS"),
        ("many_small", "check on / fastest peer"): (pytest.approx(float("nan"), nan_ok=True), 1.35, "MISS"),
        ("many_small", "check on / check off"): (round(1.3 / 1.1, 6), 1.35, "PASS"),
    }
    text = bench.targets_table(records)
    assert "| fsdp2 | transformer | bfloat16 | 1.10 (<= 1.05) MISS |" in text
    assert text.endswith("targets: 6 of 10 PASS, 4 MISS")
    on_gpu = bench.targets(rows, {"transformer": "transformer", "many_small": "many_small"}, "cuda")
    fractions = {(r["shape"], r["metric"]): (round(r["value"], 4), r["limit"], r["verdict"])
                 for r in on_gpu if not r["at_most"]}  # fmt: skip
    assert fractions == {  # 12 MB in 1.3 ms and 10 MB in 1.1 ms, where the memory moves 10 MB in 1 ms
        ("transformer", "check on, of memory"): (0.9231, 0.8, "PASS"),
        ("transformer", "check off, of memory"): (0.9091, 0.8, "PASS"),
        ("many_small", "check on, of memory"): (0.9231, 0.5, "PASS"),
        ("many_small", "check off, of memory"): (0.9091, 0.5, "PASS"),
    }
    assert "| 0.92 (>= 0.80) PASS | 0.91 (>= 0.80) PASS |" in bench.targets_table(on_gpu)


def test_a_bench_started_alone_is_a_one_rank_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # (recorded, so that what alone_at_one_rank sets is undone after the test)
        monkeypatch.delenv(key)
    bench.alone_at_one_rank()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "1")
    bench.alone_at_one_rank()  # (under torchrun: left alone)
    assert os.environ["MASTER_PORT"] == "1"


def test_the_training_loop_times_every_variant() -> None:
    config = loop.LoopConfig(layers=1, dim=8, dtype="float32", batch=4, steps=2, warmup=1, rounds=2)
    rows = loop.measure(config, torch.device("cpu"))
    assert [r.variant for r in rows] == ["no averager", "check on (default)", "check off", "background=True"]
    assert all(r.parameters == 8 * 32 + 32 + 32 * 8 + 8 and r.ms_per_step > 0 for r in rows)
    assert rows[0].added_percent == 0.0
    text = loop.table(rows, config)
    assert "| no averager |" in text and "| background=True |" in text and "0.0M parameters" in text
    on_gpu = loop.LoopRow("background=True", 10.0, 2.5, 1, "bfloat16", "cuda")
    assert (loop.verdict(on_gpu), loop.verdict(rows[3]), loop.verdict(rows[0])) == ("<= +2% MISS", "<= +2%", "-")


def test_the_loop_defaults_are_issue_38s_model_on_a_gpu() -> None:
    config = loop.defaults(torch.device("cuda"))
    model = loop.build(config, torch.device("meta"))
    assert sum(p.numel() for p in model.parameters()) == 268_517_376
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert loop.configured(torch.device("cpu"), {"run": True, "dim": 64, "steps": None}).dim == 64
    with pytest.raises(ValueError, match=r"loop: unknown keys \['width'\]"):
        loop.configured(torch.device("cpu"), {"width": 3})


def test_the_verdict_rows_against_the_unchecked_update_and_the_fp32_peers() -> None:
    """Issue 47's targets: the steady update with a verdict and the same amortized over
    ``screen_every`` (one screened update in 100), against the check-off update and the fastest
    peer that keeps an fp32 average (for bf16 weights not torchtitan-style: its average is bf16)."""
    ms = {"ours": 2.0, "ours, check off": 1.0, "floor": 1.0, "copy floor": 1.5, "stream add floor": 1.0}
    rows = rows_of_a_case("transformer", ms, {"torchtitan-style": 0.5, "hand-written fp32": 1.0})
    shards = bench.Shards(1_000_000, 2)
    rows += [
        bench.Row("fsdp2", "transformer", "bfloat16", "ours, verdict", "verdict", 1.02, 1.02, 0, 0, "bitwise",
                  floor_bytes=shards.update_bytes(False), screened=[1], timed=(4, 18)),
        bench.Row("fsdp2", "transformer", "bfloat16", "ours, verdict, screen_every=1", "verdict", 3.0, 3.0, 0, 0,
                  "bitwise", floor_bytes=shards.update_bytes(True), screened=list(range(1, 20)), timed=(4, 18)),
        bench.Row("fsdp2", "transformer", "bfloat16", "ours, check off again", "again", 1.03, 1.03, 0, 0, "bitwise",
                  floor_bytes=shards.update_bytes(False)),
    ]  # fmt: skip
    bench.against_memory(rows)
    assert bench.amortized_ms(1.02, 3.0) == pytest.approx(1.02 + (3.0 - 1.02) / 100)
    figures = bench.verdict_figures(bench.cases(rows)[("fsdp2", "transformer", "bfloat16")])
    assert figures["fastest fp32 peer"] == 1.0  # (torchtitan-style, 0.5 ms, keeps bf16)
    records = {r["metric"]: (round(r["value"], 4), r["verdict"]) for r in bench.targets(rows, {})}
    assert {m: records[m] for m, _ in bench.VERDICT_TARGETS} == {
        "verdict / check off": (1.02, "PASS"),
        "verdict / fastest fp32 peer": (1.02, "PASS"),
        "verdict amortized / check off": (1.0398, "MISS"),
        "verdict amortized / fastest fp32 peer": (1.0398, "PASS"),
    }
    text = bench.verdict_table(rows)
    assert figures["A/A"] == pytest.approx(1.03)  # (the second unchecked averager against the first)
    shown = (
        "| 0.50 (bf16 avg) | 1.00 | 1.020 PASS | 1.020 PASS | 1.040 MISS | 1.040 PASS | 1.020 | 1.030 | nan | 0 of 15 |"
    )
    assert shown in text, text  # (a run without the twin: check off is the check-off averager's)
    assert bench.verdict_table(rows_of_a_case("transformer", ms, {})) == ""  # (no verdict rows: no table)
    fp32 = [bench.Row("ddp", "s", "float32", "torchtitan-style", "peer", 1.0, 1.0, 0, 0, "peer")]
    assert bench.keeps_fp32(fp32[0]) and not bench.keeps_fp32(rows[-5])


def test_the_runs_verdicts_are_read_back_from_their_json_and_a_stranger_file_is_refused(tmp_path, capsys) -> None:
    """``tools.bench_verdicts`` reads the rows each run wrote with ``--json`` and counts, per case and
    target, the runs that met it; a file that is not such a record is refused in one line naming it."""
    ms = {"ours": 2.0, "ours, check off": 1.0, "floor": 1.0, "copy floor": 1.5, "stream add floor": 1.0}
    shards = bench.Shards(1_000_000, 2)
    paths = []
    for run, verdict_ms in enumerate((1.02, 1.04)):
        rows = rows_of_a_case("transformer", ms, {"torchtitan-style": 1.0})
        rows += [
            bench.Row("fsdp2", "transformer", "bfloat16", "ours, verdict", "verdict", verdict_ms, verdict_ms, 0, 0,
                      "bitwise", floor_bytes=shards.update_bytes(False), screened=[1], timed=(4, 18)),
            bench.Row("fsdp2", "transformer", "bfloat16", "ours, verdict, screen_every=1", "verdict", 3.0, 3.0, 0, 0,
                      "bitwise", floor_bytes=shards.update_bytes(True), timed=(4, 18)),
        ]  # fmt: skip
        paths.append(tmp_path / f"run{run}.json")
        paths[-1].write_text(json.dumps({"rows": [dataclasses.asdict(row) for row in rows]}))
    bench_verdicts.main([str(path) for path in paths])
    across = capsys.readouterr().out.split("| engine | shape | live | verdict / check off (<= 1.03)")[-1]
    assert "| fsdp2 | transformer | bfloat16 | 1.020, 1.040 (1 of 2 met) |" in across, across
    stranger = tmp_path / "config.json"
    stranger.write_text(json.dumps({"engines": ["ddp"]}))
    with pytest.raises(SystemExit, match=r"config\.json: not the JSON of a tools\.bench run \(KeyError: 'rows'\)"):
        bench_verdicts.main([str(paths[0]), str(stranger)])


def test_the_verdict_ratios_pair_the_runs_of_each_round() -> None:
    """With each round's times kept, a ratio is the median of the rounds' ratios: a burst of
    load in some rounds slows every method of those rounds alike and cancels in the pair, where a
    ratio of medians would take the verdict's slow rounds against the unchecked update's fast ones."""
    off_rounds = [1.0, 1.0, 1.0, 2.0, 2.0]  # rounds 4 and 5 under load
    verdict_rounds = [1.01, 1.01, 2.02, 2.02, 2.02]  # round 3 under load too
    row = functools.partial(bench.Row, "fsdp1", "many_small", "float32")
    rows = [
        row("ours", "ours", 3.0, 3.0, 0, 0, "bitwise", rounds_ms=[3.0] * 5),
        row("ours, check off", "ours", 1.0, 2.0, 0, 0, "bitwise", rounds_ms=off_rounds),
        row("ours, verdict", "verdict", 2.02, 2.02, 0, 0, "bitwise", rounds_ms=verdict_rounds),
        row("ours, verdict, screen_every=1", "verdict", 3.0, 3.0, 0, 0, "bitwise", rounds_ms=[3.0] * 5),
        row("torchtitan-style", "peer", 1.0, 2.0, 0, 0, "peer", rounds_ms=[1.0, 1.0, 2.0, 2.0, 2.0]),
    ]
    figures = bench.verdict_figures(bench.cases(rows)[("fsdp1", "many_small", "float32")])
    assert math.isnan(figures["A/A"]) and bench.aa_shown(figures["A/A"]) == "-"  # (a run before the A/A row)
    rows.append(row("ours, check off again", "again", 1.0, 2.0, 0, 0, "bitwise", rounds_ms=[1.05, 0.98, 1.0, 2.1, 2.0]))
    assert bench.verdict_figures(bench.cases(rows)[("fsdp1", "many_small", "float32")])["A/A"] == pytest.approx(1.0)
    assert figures["verdict"] / figures["check off"] == pytest.approx(2.02)  # (the ratio of medians)
    assert figures["verdict / check off"] == pytest.approx(1.01)  # rounds: 1.01, 1.01, 2.02, 1.01, 1.01
    assert figures["verdict / fastest fp32 peer"] == pytest.approx(1.01)
    amortized = [bench.amortized_ms(v, 3.0) for v in verdict_rounds]
    assert figures["verdict amortized / check off"] == pytest.approx(statistics.median(
        a / o for a, o in zip(amortized, off_rounds)))  # fmt: skip


def test_the_verdict_ratios_come_from_the_verdicts_own_rounds() -> None:
    """Where the verdict's phase ran, its rounds (more of them, fewer rows) make issue 47's ratios
    and the verdict table's ms, and its window counts the screens timed; the checked update and a
    peer that was not in it (a bf16 average) keep the main rounds' medians."""
    row = functools.partial(bench.Row, "ddp", "many_small", "bfloat16")
    main, phase = [2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]  # (main rounds that a bias put at 2x)
    rows = [
        row("ours", "ours", 3.0, 3.0, 0, 0, "bitwise", rounds_ms=[3.0] * 3),
        row("ours, check off", "ours", 1.0, 1.0, 0, 0, "bitwise", rounds_ms=[1.0] * 3, verdict_rounds_ms=phase),
        row("ours, verdict", "verdict", 2.0, 2.0, 0, 0, "bitwise", rounds_ms=main, screened=[1, 100],
            timed=(4, 6), verdict_rounds_ms=[1.01, 1.02, 1.0, 1.01], verdict_timed=(22, 101)),
        row("ours, verdict, screen_every=1", "verdict", 3.0, 3.0, 0, 0, "bitwise", rounds_ms=[3.0] * 3,
            verdict_rounds_ms=[2.0] * 4, verdict_timed=(22, 101)),
        row("ours, check off again", "again", 1.0, 1.0, 0, 0, "bitwise", rounds_ms=main,
            verdict_rounds_ms=[0.99, 1.0, 1.01, 1.0]),
        row("torchtitan-style", "peer", 0.5, 0.5, 0, 0, "peer", rounds_ms=[0.5] * 3),
        row("hand-written fp32", "peer", 9.0, 9.0, 0, 0, "peer", rounds_ms=[9.0] * 3, verdict_rounds_ms=[1.1] * 4),
    ]  # fmt: skip
    figures = bench.verdict_figures(bench.cases(rows)[("ddp", "many_small", "bfloat16")])
    assert figures["verdict / check off"] == pytest.approx(1.01) and figures["A/A"] == pytest.approx(1.0)
    assert figures["verdict / another averager"] == pytest.approx(1.01)
    twin = [1.01, 1.02, 0.98, 1.0]  # (the verdict's own averager with the check off: what the targets divide by)
    rows.append(row(bench.TWIN, "twin", 1.0, 1.0, 0, 0, "-", verdict_rounds_ms=twin, verdict_timed=(22, 101)))
    with_twin = bench.verdict_figures(bench.cases(rows)[("ddp", "many_small", "bfloat16")])
    assert with_twin["verdict / check off"] == pytest.approx(statistics.median([1.0, 1.0, 1.0 / 0.98, 1.01]))
    assert with_twin["check off"] == pytest.approx(1.005) and with_twin["verdict / another averager"] == figures[
        "verdict / another averager"]  # fmt: skip
    skipped = [0.5, 0.52, 0.49, 0.5]  # (a step with a false verdict: the screen alone)
    rows.append(row(bench.SKIPPED, "skipped", 0.5, 0.5, 0, 0, "-", verdict_rounds_ms=skipped, verdict_timed=(22, 101)))
    with_skipped = bench.verdict_figures(bench.cases(rows)[("ddp", "many_small", "bfloat16")])
    assert with_skipped["skipped step / check off"] == pytest.approx(statistics.median([0.5, 0.52, 0.49, 0.5]) / 1.0)
    assert "| 1.000 | 0.500 | 1 of 80 | bitwise |" in bench.verdict_table(rows)
    del rows[-2:]
    assert figures["verdict / fastest fp32 peer"] == pytest.approx(1.01 / 1.1)
    assert figures["verdict amortized / check off"] == pytest.approx(1.01 + 0.99 / 100)
    assert (figures["verdict"], figures["check on"], figures["fastest fp32 peer"]) == (1.01, 3.0, 1.1)
    assert bench.verdict_window(rows[2]) == (22, 101) and bench.verdict_window(rows[0]) == (0, 0)
    text = bench.verdict_table(rows)
    assert "| 1.01 | 2.00 | 1.02 | 1.00 | 3.00 | 0.50 (bf16 avg) | 1.10 | 1.010 PASS |" in text, text
    assert "| 1.000 | nan | 1 of 80 | bitwise |" in text, text  # (update 100 screened: in the phase's window)


def test_each_round_shuffles_the_order_alike_on_every_rank(tmp_path) -> None:
    """Every run once a round, in an order drawn from the round's number (the same on every rank,
    whose runs may communicate), so a run does not always follow the same one: an order that only
    turned kept each run behind one neighbour every round, a bias no number of rounds removes."""
    import torch.distributed as dist

    from tools.measure import interleaved_ms

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        calls: list[str] = []
        runs = [functools.partial(calls.append, name) for name in "abcde"]
        timings = interleaved_ms(runs, 2, 10, before=lambda: calls.append("|"))
        again: list[str] = []
        interleaved_ms([functools.partial(again.append, name) for name in "abcde"], 2, 10, lambda: again.append("|"))
    finally:
        dist.destroy_process_group()
    rounds = "".join(calls).split("|")[1:]
    assert len(rounds) == 12 and all(sorted(r) == list("abcde") for r in rounds), rounds
    assert "".join(again) == "".join(calls)  # (seeded by the round: every rank runs the same order)
    behind = {name: {r[r.index(name) - 1] for r in rounds if r.index(name)} for name in "abcde"}
    assert all(len(before) >= 3 for before in behind.values()), behind
    assert [len(t.rounds_ms) for t in timings] == [10] * 5  # (the warm-up rounds not kept)


@pytest.mark.parametrize(
    ("key", "value"),
    [("repeats", 0), ("verdict_repeats.many_small", -1), ("warmup", 1.5), ("verdict_repeats.transformer", None)],
)
def test_a_bad_count_of_rounds_is_refused_naming_its_key(key: str, value: object) -> None:
    cfg = bench_config()
    bench.check_rounds(cfg)  # (the shipped values pass)
    *parents, last = key.split(".")
    (cfg[parents[0]] if parents else cfg)[last] = value
    refused = rf"^{re.escape(key)}: {value!r} is not a count of rounds; expected an int >= "
    with pytest.raises(ValueError, match=refused):
        bench.check_rounds(cfg)


@pytest.mark.parametrize("verdicts", [80, {"transformer": 80}, {"transformer": 80, "many_small": 320, "other": 5}])
def test_the_verdicts_rounds_are_counted_for_each_shape(verdicts: object) -> None:
    cfg = bench_config() | {"verdict_repeats": verdicts}
    with pytest.raises(ValueError, match=r"^verdict_repeats: .*; expected a count of rounds for each shape of "):
        bench.check_rounds(cfg)


def bench_config() -> dict:
    """configs/bench.yaml, as the bench reads it."""
    return configs.load(Path(__file__).resolve().parents[1] / "configs" / "bench.yaml")
