"""An averager's settings, each declared once, and what they decide: each tensor's role.

An option is one field of ``Options`` and nothing else: its type, its default, the check it
passes where it enters (``WeightAverager(**options)``, or a description's ``options`` read back
from a file), whether descriptions record it, and its docstring, which the API reference shows.
``WeightAverager`` and the integrations pass their keywords through to it, and a description
writes and reads it with ``to_json``/``from_json``: adding a field here is adding an option.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from fnmatch import fnmatchcase
from typing import Any, Literal

import torch

from ..base import validate
from ..base.dtypes import DTYPES, dtype_name
from ..base.errors import CheckpointError
from ..layouts.tensor_info import TensorInfo

Role = Literal["average", "copy", "live"]  # averaged; copied at each update; not stored (live value exported)
BufferPolicy = Literal["copy", "average", "ignore"]
NonfinitePolicy = Literal["raise", "skip", "off"]

Check = Callable[[str, Any], Any]  # (name, value) -> the value kept, or ValueError naming the option


def option(
    default: Any,
    check: Check,
    recorded: bool = False,
    required: bool = False,
    to_json: Callable[[Any], Any] | None = None,
    from_json: Callable[[Any], Any] | None = None,
) -> Any:
    """Declare one field of ``Options``: its default, its check and how descriptions keep it.

    Args:
        default: The value when the option is not given.
        check: Called with the option's name and value where it enters; returns the value kept
            (a device string becomes a ``torch.device``) or raises ``ValueError`` naming it.
        recorded: Descriptions (checkpoints, DCP, exports) record it: it shapes the saved average.
        required: A recorded option every description since format 2 holds; one added later is
            read as its default where a description lacks it (written before it existed).
        to_json: Its value as JSON (default: the value itself).
        from_json: Its value from JSON, raising ``ValueError`` for a value it cannot be (default:
            the JSON value itself); ``check`` then runs on the result.

    Returns:
        The dataclass field.
    """
    metadata = {
        "check": check, "recorded": recorded, "required": required,
        "to_json": to_json or _itself, "from_json": from_json or _itself,
    }  # fmt: skip
    return field(default=default, metadata=metadata)


def _itself(value: Any) -> Any:
    """A plain JSON value: its own JSON."""
    return value


def _count(minimum: int) -> Check:
    """An int (never a bool) of at least ``minimum``."""

    def check(name: str, value: Any) -> int:
        validate.count(name, value, minimum)
        return value

    return check


def _policy(choices: Any) -> Check:
    """One of a ``Literal``'s values."""

    def check(name: str, value: Any) -> str:
        validate.choice(f"{name} policy", value, choices)
        return value

    return check


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _floating_dtype(name: str, value: Any) -> torch.dtype | None:
    validate.floating_dtype(name, value)
    return value


def _patterns(optional: bool) -> Check:
    """Glob patterns: one string, or a list, tuple or set of them, kept as a sorted tuple without
    repeats (a set's order differs between processes, and the order never matters); with
    ``optional``, ``None`` (no filter) too, and an empty collection refused (it would select nothing)."""

    def check(name: str, value: Any) -> tuple[str, ...] | None:
        if value is None:
            return None if optional else ()
        patterns = (value,) if isinstance(value, str) else value
        if not (
            isinstance(patterns, (list, tuple, set, frozenset)) and all(isinstance(p, str) and p for p in patterns)
        ):
            raise ValueError(f"{name} must be a glob pattern or a list of them (non-empty strings), got {value!r}")
        if optional and not patterns:
            raise ValueError(f"{name}=[] would average no tensor: pass None (the default) to average every tensor")
        return tuple(sorted(set(patterns)))

    return check


def _patterns_to_json(value: tuple[str, ...] | None) -> list[str] | None:
    return None if value is None else list(value)


def _matches(names: Sequence[str], patterns: Collection[str]) -> bool:
    """Whether a pattern matches one of ``names``, case-sensitively on every system (``fnmatchcase``)."""
    return any(fnmatchcase(name, pattern) for name in names for pattern in patterns)


def _dtype_from_json(value: Any) -> torch.dtype | None:
    if value is None:
        return None
    if not (isinstance(value, str) and value in DTYPES):
        raise ValueError(f"{value!r} is not a dtype name")
    return DTYPES[value]


@dataclass(frozen=True, kw_only=True)
class Options:
    """How an averager averages: the settings ``WeightAverager`` takes besides the model and the rule.

    Each option is declared and documented here, once: ``WeightAverager(model, rule, **options)``
    and the integrations pass their keywords of these names through, ``avg.options`` gives them
    back, and checkpoints record those that shape the saved average (``to_json``). A value out of
    its range is refused on construction, naming it.

    Raises:
        ValueError: An option out of its range or not one of its choices.
        TypeError: An option that does not exist.
    """

    every_n_steps: int = option(1, _count(1), recorded=True, required=True)
    """Update every ``every_n_steps`` optimizer steps, counted from ``start_step``. Default 1 (every step)."""

    start_step: int = option(0, _count(0), recorded=True, required=True)
    """The first step that updates; that update copies the live weights. Default 0."""

    dtype: torch.dtype | None = option(
        torch.float32, _floating_dtype, recorded=True, required=True,
        to_json=lambda value: None if value is None else dtype_name(value), from_json=_dtype_from_json,
    )  # fmt: skip
    """Shadow dtype of floating tensors. The default, ``torch.float32``, averages bf16/fp16 weights
    without rounding each update; ``None`` keeps the live dtype."""

    buffers: BufferPolicy = option("copy", _policy(BufferPolicy), recorded=True, required=True)
    """``"copy"`` (default: the live value at each update), ``"average"`` (floating buffers averaged,
    integer ones copied) or ``"ignore"`` (not stored: exports carry the live value)."""

    device: torch.device | None = option(None, validate.device)
    """Where the shadows live: ``None`` (default) next to each local shard, ``"cpu"`` (or a device of
    this machine's accelerator, ``"cuda:1"``) offloaded there. A string is converted to a
    ``torch.device``; anything else (``"meta"``, a CUDA device the machine lacks, an int) is refused."""

    include_frozen: bool = option(False, _flag, recorded=True, required=True)
    """Also average parameters with ``requires_grad=False``; by default (False) they are not stored
    and exports carry their live values."""

    include: tuple[str, ...] | None = option(None, _patterns(optional=True), recorded=True, to_json=_patterns_to_json)
    """Average only the tensors whose name matches one of these patterns (a string is one pattern);
    ``None`` (default) averages every tensor the other options do. The others are left out: see
    ``exclude``. Names are the plain model's, as exports write them (``blocks.0.attn.qkv.weight``:
    no ``module.``, ``_fsdp_wrapped_module.`` or ``_orig_mod.``; a tied tensor matches by any of its
    names). Patterns are shell-style globs (``fnmatch``, case-sensitive): an exact name is a
    pattern of itself, so ema-pytorch's sets of names pass unchanged, ``*`` spans dots
    (``blocks.*`` is everything under ``blocks``; ema-pytorch's ``ignore_startswith_names={"pos"}``
    is ``exclude="pos*"``), ``?`` is one character and ``[...]`` a set; unlike a regular
    expression, the dots in a name need no escaping and nothing matches a part of a name by
    accident. A pattern that matches no tensor of the model is refused when the averager is built,
    naming it: a typo must not silently change what is averaged. Patterns only narrow: a frozen
    parameter also needs ``include_frozen=True``, a buffer ``buffers="average"``. Recorded in
    checkpoints: a checkpoint saved under other patterns is refused on load (``strict=False``
    warns and loads it); one saved before this option existed has none."""

    exclude: tuple[str, ...] = option((), _patterns(optional=False), recorded=True, to_json=_patterns_to_json)
    """Leave out the tensors whose name matches one of these patterns (the syntax of ``include``,
    applied after it: a tensor is averaged if it matches ``include``, when given, and no
    ``exclude`` pattern). Default: none. A tensor left out is *copied*: its shadow takes the live
    value at each update, as a copied buffer does (ema-pytorch's ``param_or_buffer_names_no_ema``;
    its ``ignore_names`` instead keep the value at construction forever), so every export,
    ``swapped()`` and ``copy_to`` is still a whole model, with those tensors as the live
    weights were at the last update."""

    on_nonfinite: NonfinitePolicy = option("raise", _policy(NonfinitePolicy))
    """What a NaN or infinity in a live weight does: ``"raise"`` (default) raises ``NonFiniteError``
    and ``"skip"`` warns, both leaving the average untouched; ``"off"`` skips the check (one read of
    every local shard less per update) and averages whatever is there."""

    screen_every: int = option(100, _count(1))
    """With the loop's verdict (``update(finite=...)``), the non-finite screen still runs at one
    update in ``screen_every``, and at the first after the averager is built, restored (``load``,
    ``load_state_dict``, ``restart``), copied into the model or handed new live tensors, after a
    step it did not see with a verdict, and after a screen that found NaN; at every false verdict
    it runs at that step; the other updates take the verdict alone (``update/check.py``). A verdict
    proves the weights stayed finite only if they were finite before: the screen is what says
    they were, and what finds a NaN written outside the optimizer (within ``screen_every``
    updates; such a value is averaged in until then). Default 100: the screen costs about half
    an update (one more read of every live byte), so it adds about 0.5% to the updates' cost.
    ``1`` screens every update, verdict or not. Not used under ``on_nonfinite="off"``."""

    background: bool = option(False, _flag)
    """Run each update on a thread of its own (default False): ``update()`` returns once it has
    copied the buffers; the next optimizer step, and every reader of the averages, waits for it; an
    error it meets is raised, and a warning it gives (a skipped update) is issued, at the next call,
    in the caller's thread. The averages are bitwise those of the update in the loop."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            object.__setattr__(self, spec.name, spec.metadata["check"](spec.name, getattr(self, spec.name)))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's name, in declaration order.

        Returns:
            The field names.
        """
        return tuple(spec.name for spec in fields(cls))

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any], caller: str, own: tuple[str, ...] = ()) -> Options:
        """The options that ``caller``'s keyword arguments name (its ``own`` keywords left out), checked.

        Args:
            keywords: Keyword arguments, each an option's name or one of ``own``.
            caller: Who took them, for the message (``"WeightAverager"``).
            own: The caller's keywords that are not options.

        Returns:
            The options.

        Raises:
            TypeError: A keyword that is neither an option nor one of ``own``, named with the known ones.
            ValueError: An option out of its range or not one of its choices.
        """
        unknown = sorted(set(keywords) - set(cls.names()) - set(own))
        if unknown:
            raise TypeError(
                f"{caller} got unknown keyword argument(s) {unknown}: it takes {', '.join((*own, *cls.names()))} "
                "(the options are documented in shardavg.update.options.Options)"
            )
        return cls(**{name: value for name, value in keywords.items() if name not in own})

    def to_json(self) -> dict[str, Any]:
        """The options that shape the saved average, as a description records them.

        An option added after the format (not ``required``) is written only where it differs from
        its default: a reader that predates it refuses an option it does not know, and takes the
        default for one that is not there, so an average saved without it stays readable there.

        Returns:
            Each recorded option by name (a dtype by its name, or None), in declaration order.
        """
        return {
            spec.name: spec.metadata["to_json"](getattr(self, spec.name))
            for spec in fields(self)
            if spec.metadata["recorded"] and (spec.metadata["required"] or getattr(self, spec.name) != spec.default)
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> Options:
        """The options a description recorded (``to_json``), checked as on construction; the
        options it does not record take their defaults.

        Args:
            data: The description's ``options``, as parsed JSON.
            where: Where it came from, for the message.

        Returns:
            The options.

        Raises:
            CheckpointError: ``data`` lacks a required option, holds one not recorded, or a value
                an option refuses (one line naming ``where`` and each value at fault).
        """
        recorded = [spec for spec in fields(cls) if spec.metadata["recorded"]]
        required = sorted(spec.name for spec in recorded if spec.metadata["required"])
        optional = sorted(spec.name for spec in recorded if not spec.metadata["required"])
        if not (isinstance(data, dict) and set(required) <= set(data) <= {spec.name for spec in recorded}):
            also = f" (and may hold {optional})" if optional else ""
            raise CheckpointError(f"{where}: 'options' must hold {required}{also}, got {str(data)[:200]}")
        values, wrong = {}, []
        for spec in (spec for spec in recorded if spec.name in data):
            try:
                values[spec.name] = spec.metadata["check"](spec.name, spec.metadata["from_json"](data[spec.name]))
            except (ValueError, TypeError):
                wrong.append(f"{spec.name}={str(repr(data[spec.name]))[:80]}")
        if wrong:
            raise CheckpointError(f"{where}: 'options' has invalid values: {', '.join(wrong)}")
        return cls(**values)

    def role(self, info: TensorInfo) -> Role:
        """What the averager does with one tensor under these options: its kind, ``include_frozen``
        and ``buffers`` say whether it would be averaged, and ``include``/``exclude`` may then leave
        it out, copied instead (so that exports stay whole models).

        Args:
            info: The tensor, as the strategy lists it.

        Returns:
            ``"average"`` (averaged by the rule), ``"copy"`` (its live value copied at each
                update) or ``"live"`` (not stored: exports carry the live value).
        """
        if info.kind == "param":
            role: Role = "average" if info.requires_grad or self.include_frozen else "live"
        elif self.buffers == "ignore":
            role = "live"
        elif self.buffers == "average" and info.dtype.is_floating_point:
            role = "average"
        else:
            role = "copy"
        return "copy" if role == "average" and not self.selects(info) else role

    def selects(self, info: TensorInfo) -> bool:
        """Whether ``include`` and ``exclude`` leave a tensor to be averaged: one of its names
        matches an ``include`` pattern (when there are any) and none matches an ``exclude`` one.

        Args:
            info: The tensor, as the strategy lists it.

        Returns:
            False for a tensor the patterns leave out (copied at each update instead).
        """
        included = self.include is None or _matches(info.names, self.include)
        return included and not _matches(info.names, self.exclude)

    def roles(self, infos: Sequence[TensorInfo]) -> list[Role]:
        """Every tensor's ``role``, once each ``include`` and ``exclude`` pattern is known to match
        one of the model's names (every strategy lists the whole model's, on every rank).

        Args:
            infos: The model's tensors, as the strategy lists them.

        Returns:
            Their roles, in order.

        Raises:
            ValueError: A pattern that matches no tensor (a typo, or a wrapper's prefix), named.
        """
        names = [name for info in infos for name in info.names]
        for which in ("include", "exclude"):
            unmatched = [pattern for pattern in getattr(self, which) or () if not _matches(names, [pattern])]
            if unmatched:
                example = f" (such as {max(names, key=lambda name: name.count('.'))!r})" if names else ""
                raise ValueError(
                    f"{which} pattern(s) {unmatched} match no tensor of the model: patterns are globs over the "
                    f"plain model's names{example}, without wrapper prefixes such as 'module.'; correct or remove them"
                )
        return [self.role(info) for info in infos]

    def due(self, step: int) -> bool:
        """Whether an update runs at ``step``: ``start_step``, then every ``every_n_steps``.

        Args:
            step: An optimizer step count.

        Returns:
            True when ``step`` is ``start_step + k * every_n_steps`` for some ``k >= 0``.
        """
        return step >= self.start_step and not (step - self.start_step) % self.every_n_steps
