"""The merge's methods apart from its I/O (``offline.methods``): each a small class with its parameters
declared once, registered by name; the merge and the command line take a method registered here without
naming it (one class added, nothing else), and a name that is not registered is refused listing those
that are."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers import in_process_cli
from test_merge import read_model
from test_merge_megatron import assert_matches, megatron_save, model, numpy_mean

import shardavg
from shardavg.offline import methods


@dataclass(frozen=True)
class Newest(methods.Method):
    """A method of one's own: the newest ``count`` inputs alike, the others not at all."""

    name: ClassVar[str] = "newest"
    keyword: ClassVar[str | None] = "newest"
    parameter: ClassVar[str] = "count"
    option: ClassVar[dict[str, Any]] = {"type": int, "metavar": "K", "help": "the newest K inputs alike"}

    count: int

    def shares(self, steps, accumulate) -> list[float]:
        return [0.0] * (len(steps) - self.count) + [1.0 / self.count] * self.count


def iterations(root: Path) -> list[Path]:
    folders = [root / f"iter_{step:07d}" for step in (10, 20, 30)]
    for seed, folder in enumerate(folders):
        megatron_save(folder, model(seed), root / "unpickled", tp=1)
    return folders


def test_a_method_registered_in_one_place_is_taken_by_the_merge_and_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(methods.METHODS, Newest.name, Newest)  # (what @register does, undone after the test)
    inputs = iterations(tmp_path / "run")
    dtypes = {name: t.dtype for name, t in model(0).items()}
    want = numpy_mean([model(0), model(1), model(2)], [0.0, 0.5, 0.5])
    assert_matches(read_model(shardavg.merge(inputs, tmp_path / "python", method=Newest(2))), want, dtypes)
    done = in_process_cli("merge", *map(str, inputs), "--newest", "2", "--out", str(tmp_path / "cli"), "--quiet")
    assert done.returncode == 0, done.stderr
    assert_matches(read_model(tmp_path / "cli"), want, dtypes)
    shown = " ".join(in_process_cli("merge", "--help").stdout.split())
    assert "--newest K the newest K inputs alike" in shown, shown
    refused = in_process_cli("merge", *map(str, inputs), "--newest", "2", "--ema", "0.5", "--out", str(tmp_path / "x"))
    assert refused.returncode == 2 and "argument --ema: not allowed with argument --newest" in refused.stderr


def test_the_registry_names_what_it_holds_and_a_method_is_given_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no merge method named 'soup': the methods are uniform, weights, ema, wsm"):
        methods.method("soup")
    with pytest.raises(ValueError, match="a merge method named 'ema' is registered already"):
        methods.register(methods.Ema)
    inputs = iterations(tmp_path / "run")
    with pytest.raises(ValueError, match="ema and method each give the inputs' weights: pass one"):
        shardavg.merge(inputs, tmp_path / "out", ema=0.5, method="uniform")
    with pytest.raises(ValueError, match="normalize=False takes the weights as given"):
        shardavg.merge(inputs, tmp_path / "out", method=methods.Wsm("cosine"), normalize=False)
    assert not (tmp_path / "out").exists()
    dtypes = {name: t.dtype for name, t in model(0).items()}
    by_name = shardavg.merge(inputs, tmp_path / "soup", method="uniform")
    assert_matches(read_model(by_name), numpy_mean([model(0), model(1), model(2)], [1 / 3] * 3), dtypes)
    shares = methods.Wsm("cosine").shares([10, 20, 30], torch.float32)
    as_keyword = shardavg.merge(inputs, tmp_path / "wsm", schedule="cosine")
    as_method = shardavg.merge(inputs, tmp_path / "wsm-method", method=methods.Wsm("cosine"))
    assert_matches(read_model(as_method), numpy_mean([model(0), model(1), model(2)], shares), dtypes)
    by_keyword = read_model(as_keyword)
    assert all(torch.equal(tensor, by_keyword[name]) for name, tensor in read_model(as_method).items())
    assert '"schedule": "cosine"' in (as_method / "provenance.json").read_text()  # (recorded as before)
