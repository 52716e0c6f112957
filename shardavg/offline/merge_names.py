"""The tensors a merge writes, and the names it writes each under: planned before anything is read.

Names tied in any input (stored once: an averager's aliases, a Hugging Face folder's output
embedding) are one tensor (``plan_names``); every input must hold every tensor of the first, in
the same shape (``_check_agree``); ``include``/``exclude`` patterns select among them
(``selected``); each merged tensor's output dtype follows the inputs' or the one asked for
(``output_spec``). The result is plain data (``Planned``: the names written, the name read from
each input), which the merge's plan carries to its writers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase

import torch

from ..base.errors import CheckpointError
from ..output.model_writer import cast_dtype
from .sources import SafetensorsSource, Source, Spec


@dataclass(frozen=True)
class Planned:
    """One merged tensor: the names it is written under, and the name read from each input."""

    names: tuple[str, ...]
    held: tuple[str, ...]  # one per input
    untied: bool = False  # a name of a group some input ties and another does not


def plan_names(sources: list[Source], model_folder: bool) -> list[Planned]:
    """What to merge and under which names, in the first input's order.

    Names are grouped where any input ties them (stores them once). Every input must hold
    every group, in the same shapes. A group every input ties is merged once and written under
    every name, or, written as a model folder (``model_folder``) with a Hugging Face input, under
    the names the newest such input holds (Transformers saves a tied ``lm_head.weight`` not at all); a
    group some input holds as distinct tensors is merged name by name, a tied input giving its
    one tensor to each name."""
    groups = _tie_groups(sources)
    held = [_held(source, groups) for source in sources]
    _check_agree(sources, held)
    newest_hf = next((i for i in reversed(range(len(sources))) if isinstance(sources[i], SafetensorsSource)), None)
    plan = []
    for group, first in held[0].items():
        names = sorted(group, key=lambda n: (n not in first, first.index(n) if n in first else 0, n))
        if all(_tied(source, h[group]) for source, h in zip(sources, held)):
            written = tuple(names) if not model_folder or newest_hf is None else held[newest_hf][group]
            plan.append(Planned(written, tuple(h[group][0] for h in held)))
        else:
            untied = len(names) > 1
            plan += [Planned((n,), tuple(n if n in h[group] else h[group][0] for h in held), untied) for n in names]
    return plan


EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|tok_embeddings|embed_in|embeddings?)(\.|$)")


def tie_saved_once(sources: list[Source]) -> None:
    """Tie, in each Hugging Face input whose config ties word embeddings, a tensor it lacks but
    another input holds (the output embedding, which Transformers saves once) to the one it holds
    in its place: the floating tensor of that shape named as an input embedding, else the one
    another input holds, equal, under both names. Nothing is tied where that is not one tensor."""
    for source in sources:
        if not isinstance(source, SafetensorsSource) or not source.ties_embeddings:
            continue
        elsewhere = {n: s.specs[n] for s in sources if s is not source for n in s.specs}
        for name in sorted(elsewhere.keys() - source.specs.keys()):
            shape = elsewhere[name].shape
            same = [n for n, spec in source.specs.items() if spec.shape == shape and spec.dtype.is_floating_point]
            found = [n for n in same if EMBEDDING.search(n)]
            if len(found) != 1:
                found = [n for n in same if any(_stored_equal(s, name, n) for s in sources if s is not source)]
            if len(found) == 1:
                source.ties = [*source.ties, (found[0], name)]


def _stored_equal(source: Source, first: str, second: str) -> bool:
    """Whether ``source`` holds both names, equal (one tensor stored twice, like a DCP checkpoint
    of a tied model)."""
    return first in source.specs and second in source.specs and _tied(source, (first, second))


def _tie_groups(sources: list[Source]) -> dict[str, frozenset[str]]:
    """``{name: its group}``: names tied in any input joined (a name alone is its own group)."""
    group = {name: frozenset([name]) for source in sources for name in source.specs}
    for source in sources:
        for tie in source.ties:
            joined = frozenset().union(*(group.get(name, frozenset([name])) for name in tie))
            for name in joined:
                group[name] = joined
    return group


def _held(source: Source, groups: dict[str, frozenset[str]]) -> dict[frozenset[str], tuple[str, ...]]:
    """``{group: the names of it this input stores}``, in the input's order."""
    found: dict[frozenset[str], tuple[str, ...]] = {}
    for name in source.specs:
        found[groups[name]] = (*found.get(groups[name], ()), name)
    return found


def _tied(source: Source, names: tuple[str, ...]) -> bool:
    """Whether the input holds one tensor for ``names``: stored once, or equal under each name
    (a DCP checkpoint of a tied model stores it under both)."""
    if len(names) == 1:
        return True
    first = source.read(names[0])
    return all(torch.equal(first, source.read(name)) for name in names[1:])


def _check_agree(sources: list[Source], held: list[dict[frozenset[str], tuple[str, ...]]]) -> None:
    """Every input holds every tensor of the first (a tied group by any of its names), in the
    same shape (floating tensors may differ in dtype, like a bf16 model and fp32 averages)."""
    first = sources[0]
    for source, holds in zip(sources[1:], held[1:]):
        missing = sorted(min(group) for group in held[0].keys() - holds.keys())
        unexpected = sorted(min(group) for group in holds.keys() - held[0].keys())
        wrong = sorted(
            f"{name}: {source.specs[name]} vs {first.specs[held[0][group][0]]}"
            for group, names in holds.items()
            if group in held[0]
            for name in names
            if not _compatible(first.specs[held[0][group][0]], source.specs[name])
        )
        if missing or unexpected or wrong:
            raise CheckpointError(
                f"{source} does not match {first}: missing {_some(missing)}, unexpected {_some(unexpected)}, "
                f"mis-shaped or of another dtype {_some(wrong)}"
            )


def _compatible(a: Spec, b: Spec) -> bool:
    if a.shape != b.shape or a.dtype.is_floating_point != b.dtype.is_floating_point:
        return False
    return a.dtype.is_floating_point or a.dtype == b.dtype


def _some(names: list[str]) -> str:
    return str(names[:8])[:-1] + (f", ... {len(names) - 8} more]" if len(names) > 8 else "]")


def patterns(what: str, given: Sequence[str] | str | None) -> tuple[str, ...]:
    """The ``fnmatch`` patterns ``include`` or ``exclude`` (``what``) gives: none, or non-empty strings."""
    if given is None:
        return ()
    if isinstance(given, str) or not all(isinstance(p, str) and p for p in given):
        raise ValueError(f"{what} takes a list of non-empty name patterns (fnmatch), got {given!r}")
    return tuple(given)


def selected(plan: list[Planned], include: tuple[str, ...], exclude: tuple[str, ...]) -> list[Planned]:
    """The plan's names that match an ``include`` pattern (when any is given) and no ``exclude`` one."""

    def wanted(name: str) -> bool:
        return (not include or any(fnmatchcase(name, p) for p in include)) and not any(
            fnmatchcase(name, p) for p in exclude
        )

    kept = [replace(p, names=tuple(n for n in p.names if wanted(n))) for p in plan]
    kept = [p for p in kept if p.names]
    if not kept:
        raise ValueError(f"no tensor is left to merge: include {list(include)}, exclude {list(exclude)}")
    return kept


def output_spec(planned: Planned, sources: list[Source], dtype: torch.dtype | None) -> Spec:
    """The merged tensor's dtype: ``dtype`` for floating tensors, else the inputs' when they agree,
    else fp32; integer tensors keep theirs."""
    found = {source.specs[name].dtype for source, name in zip(sources, planned.held)}
    first = sources[0].specs[planned.held[0]]
    if not first.dtype.is_floating_point or dtype is not None:
        return Spec(cast_dtype(first.dtype, dtype), first.shape)
    return Spec(found.pop() if len(found) == 1 else torch.float32, first.shape)
