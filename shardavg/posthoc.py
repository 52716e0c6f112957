"""Post-hoc EMA (EDM2, Karras et al. 2024, section 3 and Algorithm 3), shard-local.

A power-function EMA with exponent ``gamma`` after ``t`` updates weighs the training
trajectory with the profile ``p(tau) = (gamma + 1) tau**gamma / t**(gamma + 1)`` on ``[0, t]``.
Keeping two such averages and writing both every ``snapshot_every`` updates gives a family of
profiles from which any other power-function profile (any ``sigma_rel``, at any snapshot time)
is approximated, in the least-squares sense, by a linear combination: the coefficients solve
``A x = b`` with ``A[i, j] = <p_i, p_j>`` and ``b[i] = <p_i, p_target>``, and the synthesized
average is ``sum_i x_i * snapshot_i``, an elementwise sum that each rank computes on its own
shards. ``PostHocEMA`` keeps the averages (several named averages of one ``WeightAverager``)
and writes the snapshots (atomic sharded checkpoints, ``snapshot-<t>/``); ``synthesize`` reads
them, at any world size and under any engine, and returns an averager holding the result.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .averager import WeightAverager
from .base import validate
from .base.dist import agree_or_raise, all_gathered, rank
from .base.dtypes import dtype_name
from .base.errors import CheckpointError
from .base.logs import internal
from .base.progress import Progress
from .checkpoints.description import Description, TensorEntry
from .checkpoints.format import MANIFEST, SNAPSHOT_DIR, snapshot_folder
from .checkpoints.reading import read_manifest
from .output.model_writer import write_model
from .output.provenance import made_by, of_input
from .output.record import FolderRecord
from .output.target import check_out
from .output.write_options import DEFAULTS, WriteOptions
from .rules import PowerEMA, gamma_to_sigma_rel, rule_from_config, shown, sigma_rel_to_gamma

FIT_TOLERANCE = 0.05  # the largest relative least-squares residual a synthesis may have
MAX_T = 2**53  # updates a snapshot may record: exact in the float64 the coefficients are solved in


# --------------------------------------------------------------------------- the profiles' algebra


def profile_dot(t_a: torch.Tensor, gamma_a: torch.Tensor, t_b: torch.Tensor, gamma_b: torch.Tensor) -> torch.Tensor:
    """``<p_a, p_b>``, the integral of the product of two power-function profiles (broadcasting,
    float64): ``(ga + 1)(gb + 1) m**(ga + gb + 1) / ((ga + gb + 1) t_a**(ga + 1) t_b**(gb + 1))``
    with ``m = min(t_a, t_b)``, evaluated in log space so that large ``t`` and ``gamma`` do not
    overflow, and with the powers of ``m`` grouped against ``t_a`` and ``t_b``
    (``(ga + 1) log(m / t_a) + (gb + 1) log(m / t_b) - log m``) so that no two large terms cancel."""
    m = torch.minimum(t_a, t_b)
    log = (
        torch.log1p(gamma_a)
        + torch.log1p(gamma_b)
        - torch.log(gamma_a + gamma_b + 1)
        + (gamma_a + 1) * torch.log(m / t_a)
        + (gamma_b + 1) * torch.log(m / t_b)
        - torch.log(m)
    )
    return torch.exp(log)


def solve_coefficients(
    ts: list[float], gammas: list[float], t_target: float, gamma_target: float
) -> tuple[torch.Tensor, float]:
    """The least-squares coefficients of the snapshots ``(ts[i], gammas[i])`` for the target
    profile, in float64, and the fit's relative residual ``|sum x_i p_i - p_target| / |p_target|``.

    The least-squares solution is divided by its sum, as EDM2's released code does: every
    power-function EMA weighs the trajectory with weights that sum to exactly 1, so the
    combination must too, or a parameter that never changes would come back scaled (by 1.034
    at sigma_rel 0.07 from two snapshots). Every ``t`` must be >= 1 and every gamma > -0.5
    (``target_gamma``); inner products that still come out non-finite are refused here rather
    than handed to LAPACK."""
    t = torch.tensor(ts, dtype=torch.float64)
    g = torch.tensor(gammas, dtype=torch.float64)
    tr = torch.tensor([t_target], dtype=torch.float64)
    gr = torch.tensor([gamma_target], dtype=torch.float64)
    a = profile_dot(t[:, None], g[:, None], t[None, :], g[None, :])
    b = profile_dot(t[:, None], g[:, None], tr[None, :], gr[None, :])[:, 0]
    target = profile_dot(tr, gr, tr, gr)[0]
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()) and float(target) > 0):
        raise ValueError(
            f"the profiles' inner products are not finite for t {ts} and gamma {gammas} (target t {t_target}, "
            f"gamma {gamma_target}): every t must be >= 1 and every gamma > -0.5"
        )
    x = torch.linalg.lstsq(a, b[:, None], driver="gelsd").solution[:, 0]
    x = x / x.sum()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"the least-squares solution for gamma {gamma_target} at t {t_target} is not finite")
    residual = (target - 2 * x @ b + x @ a @ x).clamp_min(0)
    return x, math.sqrt(float(residual / target))


def target_gamma(sigma_rel: float | None = None, gamma: float | None = None) -> float:
    """The exponent of a post-hoc profile or synthesis target given by ``sigma_rel`` or ``gamma``,
    checked: a valid ``PowerEMA`` whose profile has a finite inner product with itself (the
    integral of ``tau**(2 gamma)`` from 0 exists only for ``gamma > -0.5``; every ``sigma_rel``
    gives a gamma above -0.4). ValueError otherwise."""
    exponent = PowerEMA(gamma=gamma, sigma_rel=sigma_rel).exponent
    if not exponent > -0.5:
        raise ValueError(
            f"gamma {shown(gamma)} is too wide for post-hoc EMA: a profile needs gamma > -0.5, or its inner "
            "products (the integral of tau**(2 gamma) from 0) do not exist"
        )
    return exponent


def _profile_rules(sigma_rels: Any, gammas: Any) -> list[PowerEMA]:
    """The profiles ``PostHocEMA`` keeps, each given as it was (``sigma_rel`` or ``gamma``) and
    checked by ``target_gamma``."""
    if gammas is not None:
        values, key = gammas, "gamma"
    elif sigma_rels is not None:
        values, key = sigma_rels, "sigma_rel"
    else:
        raise ValueError("PostHocEMA needs sigma_rels= or gammas=")
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise ValueError(f"PostHocEMA {key}s must be a list or tuple of numbers, got {shown(values)}")
    for value in values:
        target_gamma(**{key: value})
    return [PowerEMA(**{key: value}) for value in values]


# --------------------------------------------------------------------------- snapshots on disk


class Snapshot:
    """One snapshot folder: its update count ``t``, training step, and profiles (rules, gammas) by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        saved = read_manifest(path)
        self.t = saved.num_updates
        if not 1 <= self.t <= MAX_T:
            raise CheckpointError(
                f"{path} was written after {self.t} updates: a snapshot holds at least one and at most 2**53 (its "
                "profiles' inner products exist for t >= 1)"
            )
        self.step = saved.step
        self.world_size = saved.world_size or 1
        self.run: str | None = saved.run  # the PostHocEMA run that wrote it (None: before runs had one)
        self.rules: dict[str, PowerEMA] = {}
        for average in saved.averages:
            rule = rule_from_config(average.rule) if average.rule.get("kind") != "custom" else None
            if not isinstance(rule, PowerEMA) or average.name is None:
                raise CheckpointError(f"{path}: average {average.name!r} is not a named power-function EMA profile")
            try:
                target_gamma(gamma=rule.exponent)
            except ValueError as error:
                raise CheckpointError(f"{path}: profile {average.name!r}: {error}") from None
            self.rules[average.name] = rule
        self.gammas = {name: rule.exponent for name, rule in self.rules.items()}
        self.tensors = {entry.name: entry for entry in saved.tensors}
        missing = [name for name in saved.files if not (path / name).is_file()]
        if missing:
            raise CheckpointError(f"{path} lacks {missing}: a truncated or partly deleted snapshot")
        self.bytes = sum((path / name).stat().st_size for name in saved.files)


def snapshots(directory: str | os.PathLike) -> list[Snapshot]:
    """The committed snapshots under ``directory``, by update count; refuses mixed models and
    fewer than two profiles."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"no snapshot folder at {directory}")
    found = [
        Snapshot(p) for p in sorted(directory.iterdir()) if SNAPSHOT_DIR.match(p.name) and (p / MANIFEST).is_file()
    ]
    if not found:
        raise CheckpointError(f"{directory} holds no committed snapshot-<t> folder")
    found.sort(key=lambda s: s.t)
    first = found[0]
    run_ids = {s.run for s in found}
    if len(run_ids) > 1:
        other = next(s for s in found if s.run != first.run)
        raise CheckpointError(
            f"{directory} mixes the snapshots of {len(run_ids)} runs ({first.path.name} is run {first.run}, "
            f"{other.path.name} run {other.run}): synthesize from one run's snapshots, one folder per run"
        )
    for other in found[1:]:
        shapes = {n: e.shape for n, e in other.tensors.items()}
        if shapes != {n: e.shape for n, e in first.tensors.items()} or other.gammas != first.gammas:
            raise CheckpointError(
                f"{other.path} and {first.path} are snapshots of different models or profiles: one folder per run"
            )
    if len(first.gammas) < 2:
        raise CheckpointError(
            f"{directory}: the snapshots keep {len(first.gammas)} profile(s); synthesis needs at least two"
        )
    return found


def plan(found: list[Snapshot], gamma: float, step: int | None) -> tuple[list[tuple[Snapshot, str, float]], int]:
    """``[(snapshot, profile, coefficient)]`` for the target ``gamma`` at ``step`` (the last
    snapshot's by default; snapshots after it are not used), and the target's update count."""
    if step is None:
        usable = found
    else:
        usable = [s for s in found if s.step <= step]
        if not usable or usable[-1].step != step:
            steps = [s.step for s in found]
            raise ValueError(f"step {step} is not a snapshot's step; the snapshots are at steps {steps}")
    target = usable[-1].t
    terms = [(s, name, g) for s in usable for name, g in s.gammas.items()]
    x, residual = solve_coefficients([s.t for s, _, _ in terms], [g for _, _, g in terms], target, gamma)
    if residual > FIT_TOLERANCE:
        raise ValueError(
            f"sigma_rel {gamma_to_sigma_rel(gamma):.4g} (gamma {gamma:.4g}) cannot be synthesized well at step "
            f"{usable[-1].step} from the snapshots up to it (relative residual {residual:.3f} > {FIT_TOLERANCE}): "
            f"{synthesizable(usable)}"
        )
    return [(s, name, float(c)) for (s, name, _), c in zip(terms, x)], target


def synthesizable(found: list[Snapshot], tolerance: float = FIT_TOLERANCE) -> str:
    """The sigma_rel values in 0.01-0.29 (steps of 0.01) the snapshots synthesize within
    ``tolerance`` at the last one's step (pass the snapshots up to the step asked for), as ranges:
    with few snapshots the residual dips to 0 at each profile and rises between them, so the
    values that fit need not be one interval."""
    target = found[-1].t
    terms = [(s.t, g) for s in found for g in s.gammas.values()]
    good = [
        k
        for k in range(1, 30)
        if solve_coefficients([t for t, _ in terms], [g for _, g in terms], target, sigma_rel_to_gamma(0.01 * k))[1]
        <= tolerance
    ]
    if not good:
        return "no sigma_rel in [0.01, 0.29] fits within tolerance"
    ranges: list[list[int]] = []
    for k in good:
        if ranges and k == ranges[-1][-1] + 1:
            ranges[-1].append(k)
        else:
            ranges.append([k])
    shown = [f"{ks[0] / 100:.2f}" if len(ks) == 1 else f"{ks[0] / 100:.2f}-{ks[-1] / 100:.2f}" for ks in ranges]
    listed = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
    verb = "fits" if len(good) == 1 else "fit"
    return f"sigma_rel {listed} {verb} within {tolerance} (tried 0.01 to 0.29 in steps of 0.01)"


# --------------------------------------------------------------------------- during training


class PostHocEMA:
    """Power-function EMA profiles kept shard-local, written as sharded snapshots for post-hoc synthesis.

    Args:
        model: as for ``WeightAverager`` (any engine).
        sigma_rels: the profiles' relative widths (EDM2 uses 0.05 and 0.10); or give ``gammas``.
        snapshot_every: write every profile after each ``snapshot_every`` applied updates.
        directory: where ``snapshot-<t>/`` folders go (``t``, the update count, in the name).
        snapshot_dtype: the dtype snapshots are stored in (fp32 by default; ``torch.bfloat16``
            halves them, at bf16 rounding of each snapshot).
        averager_options: passed to ``WeightAverager`` (``dtype``, ``buffers``, ...).

    Example (one process; under torchrun every rank runs the same lines)::

        >>> import tempfile, torch, shardavg
        >>> model = torch.nn.Linear(4, 2)
        >>> ph = shardavg.PostHocEMA(model, sigma_rels=(0.05, 0.10), snapshot_every=5,
        ...                          directory=tempfile.mkdtemp())
        >>> for _ in range(20):
        ...     with torch.no_grad():
        ...         _ = model.weight.add_(0.1)  # what an optimizer step would do
        ...     _ = ph.update()
        >>> best = ph.synthesize(sigma_rel=0.08)  # any sigma_rel the profiles fit, after training
        >>> best.num_updates, sorted(best.full_state_dict())
        (20, ['bias', 'weight'])
    """

    def __init__(
        self,
        model: nn.Module,
        sigma_rels: tuple[float, ...] | None = (0.05, 0.10),
        *,
        gammas: tuple[float, ...] | None = None,
        snapshot_every: int,
        directory: str | os.PathLike,
        snapshot_dtype: torch.dtype = torch.float32,
        **averager_options: Any,
    ) -> None:
        rules = _profile_rules(sigma_rels, gammas)
        if len(rules) < 2:
            raise ValueError(f"PostHocEMA needs at least two profiles to synthesize from, got {len(rules)}")
        validate.count("snapshot_every", snapshot_every, 1)
        validate.floating_dtype("snapshot_dtype", snapshot_dtype, optional=False)
        self.model = model
        self.snapshot_every = snapshot_every
        self.directory = Path(directory)
        self.snapshot_dtype = snapshot_dtype
        self.averager_options = averager_options
        self.averager = WeightAverager(model, {f"profile-{i}": r for i, r in enumerate(rules)}, **averager_options)
        # in every snapshot (rank 0's, the same on every rank); a resumed run loads its own back
        self.averager.run_id = all_gathered(secrets.token_hex(16))[0]
        self._issued = 0  # updates applied (or issued to the device) since the profiles began
        self._folder_checked = False  # whether the snapshots already in ``directory`` are this run's

    def update(self, step: int | None = None, *, finite: bool | torch.Tensor | None = None) -> bool:
        """``averager.update(step, finite=finite)``, then a snapshot after every ``snapshot_every``-th
        applied update (counted here, so that an update checked on an accelerator is not waited for).

        Args:
            step: the training step, as for ``WeightAverager.update`` (default: one more than the last).
            finite: the loop's verdict on its step, as for ``WeightAverager.update`` (the total gradient
                norm, or False where the optimizer skipped the step): a false one is not averaged in.

        Returns:
            Whether the profiles were updated at this step.

        Raises:
            CheckpointError: at the first update, when ``directory`` holds another run's snapshots.
        """
        if not self._folder_checked:
            self._check_folder()
        applied = self.averager.update(step, finite=finite)
        if applied:
            self._issued += 1
            if self._issued % self.snapshot_every == 0:  # the name takes the settled count
                path = self.directory / snapshot_folder(self.averager.num_updates)
                self.averager.save(path, dtype=self.snapshot_dtype)
        return applied

    def _check_folder(self) -> None:
        """Collective, at the first update (after building or loading): every snapshot already in the
        folder must be this run's (a resumed run rewrites its own later ones), or synthesis would
        mix two runs."""
        error: BaseException | None = None
        if rank() == 0:
            try:
                for path in sorted(self.directory.glob("snapshot-*")) if self.directory.is_dir() else []:
                    if SNAPSHOT_DIR.match(path.name) and (path / MANIFEST).is_file():
                        theirs = read_manifest(path).run
                        if theirs != self.averager.run_id:
                            raise CheckpointError(
                                f"{self.directory} holds snapshots of another run ({path.name}, run {theirs}; this "
                                f"is run {self.averager.run_id}): write to a folder of its own, or load this "
                                "run's checkpoint before going on with it"
                            )
            except Exception as caught:
                error = caught
        agree_or_raise(error, f"checking {self.directory}")
        self._folder_checked = True

    # checkpoints of the running profiles: as a WeightAverager's (snapshots are already on disk)
    def state_dict(self) -> dict[str, Any]:
        """The running profiles as a ``torch.distributed.checkpoint`` Stateful (``WeightAverager.state_dict``).

        Returns:
            The averager's state dict: its description and every profile's shards.
        """
        return self.averager.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restore the running profiles (and the run's identity) from ``state_dict``.

        Args:
            state_dict: what ``state_dict()`` gave, as DCP loaded it.
            strict: refuse missing or unexpected tensors and other rules (``False``: warn).
        """
        self.averager.load_state_dict(state_dict, strict)  # (the run's identity too)
        self._issued = self.averager.num_updates
        self._folder_checked = False

    def save(self, directory: str | os.PathLike, keep_last: int | None = None) -> Path:
        """Collective: save the running profiles, as ``WeightAverager.save`` does.

        Args:
            directory: the checkpoint folder (with ``keep_last``, the folder of ``step-*`` checkpoints).
            keep_last: keep the newest ``keep_last`` checkpoints in ``directory``.

        Returns:
            The checkpoint written.
        """
        return self.averager.save(directory, keep_last)

    def load(self, directory: str | os.PathLike, strict: bool = True) -> Path:
        """Collective: restore the running profiles (and the run's identity) from ``save``'s checkpoint.

        Args:
            directory: a checkpoint, or a folder of ``step-*`` checkpoints (the newest is read).
            strict: refuse missing or unexpected tensors and other rules (``False``: warn).

        Returns:
            The checkpoint read.
        """
        path = self.averager.load(directory, strict)  # (the run's identity too)
        self._issued = self.averager.num_updates
        self._folder_checked = False
        return path

    def synthesize(
        self, sigma_rel: float | None = None, *, gamma: float | None = None, step: int | None = None
    ) -> WeightAverager:
        """Collective: the average of profile ``sigma_rel`` (or ``gamma``) at ``step`` (the last
        snapshot's by default), combined on each rank from its parts of the snapshots, which are
        read at this world size whatever the one they were written at.

        Args:
            sigma_rel: the relative width of the profile to synthesize (0.01 to 0.29 fit well).
            gamma: the profile's exponent instead of ``sigma_rel``.
            step: synthesize from the snapshots up to this training step (default: all of them).

        Returns:
            An averager of its own (``swapped()``, ``export``, ``save``), holding only the synthesized average.

        Raises:
            CheckpointError: when the snapshots are missing, mixed or cannot express the profile.
        """
        return synthesize(self.model, self.directory, sigma_rel, gamma=gamma, step=step, **self.averager_options)


def synthesize(
    model: nn.Module,
    directory: str | os.PathLike,
    sigma_rel: float | None = None,
    *,
    gamma: float | None = None,
    step: int | None = None,
    **averager_options: Any,
) -> WeightAverager:
    """``PostHocEMA.synthesize`` for any model and snapshot folder (collective).

    Args:
        model: the model the snapshots were taken of (any engine, any world size).
        directory: the snapshots' folder.
        sigma_rel: the relative width of the profile to synthesize.
        gamma: the profile's exponent instead of ``sigma_rel``.
        step: synthesize from the snapshots up to this training step (default: all of them).
        **averager_options: passed to ``WeightAverager``.

    Returns:
        An averager holding only the synthesized average.
    """
    target = PowerEMA(gamma=target_gamma(sigma_rel, gamma))
    found = snapshots(directory)
    terms, t_target = plan(found, target.exponent, step)
    with internal():  # the library's own averagers: they do not log as if the user had built them
        result = WeightAverager(model, target, **averager_options)
        scratch = WeightAverager(model, found[0].rules, **averager_options)  # each snapshot is read into it

    def read() -> Iterator[tuple[WeightAverager, str, float]]:
        """Each snapshot loaded into ``scratch`` in turn, then each of its terms."""
        for snapshot in dict.fromkeys(s for s, _, _ in terms):
            scratch.load(snapshot.path)
            for term_snapshot, name, coefficient in terms:
                if term_snapshot is snapshot:
                    yield scratch, name, coefficient

    result.combine(read(), step=terms[-1][0].step, num_updates=t_target)  # buffers: the last snapshot's
    return result


# --------------------------------------------------------------------------- offline


def synthesized_tensors(
    directory: str | os.PathLike, gamma: float, step: int | None = None
) -> tuple[Description, Iterator[tuple[TensorEntry, torch.Tensor]]]:
    """One process, no process group: the snapshots' description (the last used one's, its
    provenance the snapshots combined and their coefficients) and ``(tensor entry, full
    synthesized tensor)`` one tensor at a time, accumulated in the order and dtype of the
    in-process synthesis (so both give the same bits). Averaged tensors are the combination;
    copied and live ones the last snapshot's."""
    from .offline.saved_average import SavedAverage

    terms, _ = plan(snapshots(directory), target_gamma(gamma=gamma), step)
    readers = {s.path: SavedAverage(s.path) for s, _, _ in terms}
    for reader in readers.values():
        reader.verify()  # every chunk table checked before anything is written
    last = readers[terms[-1][0].path]

    def tensors() -> Iterator[tuple[TensorEntry, torch.Tensor]]:
        for name, entry in last.tensors.items():
            if entry.role != "average":
                yield entry, last.read(name, next(iter(last.averages)))
                continue
            total = torch.zeros(entry.shape, dtype=synthesized_dtype(entry))
            for snapshot, profile, coefficient in terms:
                total.add_(
                    readers[snapshot.path].read(name, profile), alpha=coefficient
                )  # one snapshot tensor at a time
            yield entry, total
            del total

    inputs = [
        of_input(snapshot.path, snapshot.step, coefficient, snapshot.run) | {"profile": profile}
        for snapshot, profile, coefficient in terms
    ]
    record = made_by("posthoc", 1, sigma_rel=gamma_to_sigma_rel(gamma), step=terms[-1][0].step, inputs=inputs)
    return replace(last.description, provenance=record), tensors()


def export_synthesized(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    sigma_rel: float,
    *,
    step: int | None = None,
    dtype: torch.dtype | None = DEFAULTS.dtype,
    max_shard_size: int | str = DEFAULTS.max_shard_size,
    progress: Progress | None = None,
) -> tuple[Path, int]:
    """One process, no process group (``shardavg posthoc``): the post-hoc EMA of ``sigma_rel`` at
    ``step`` synthesized from the snapshots in ``directory`` and written as a model folder into
    ``out``, one tensor at a time, its provenance the snapshots combined.

    Args:
        directory: the snapshots' folder (written by ``PostHocEMA`` at any world size).
        out: the model folder to write.
        sigma_rel: the relative width of the profile to synthesize.
        step: synthesize from the snapshots up to this training step (default: all of them).
        dtype: the floating tensors' dtype (``WriteOptions.dtype``; default: fp32 for averaged ones).
        max_shard_size: the largest file before the model is split (``WriteOptions.max_shard_size``).
        progress: shows the bytes as they are written (default: nothing shown).

    Returns:
        The folder written, and how many tensors (names) it holds.
    """
    options = WriteOptions(max_shard_size=max_shard_size, dtype=dtype)
    check_out(out, "posthoc")
    description, tensors = synthesized_tensors(directory, target_gamma(sigma_rel=sigma_rel), step)
    entries = [replace(e, dtype=dtype_name(synthesized_dtype(e))) for e in description.tensors]

    def values() -> Iterator[torch.Tensor]:
        for _, full in tensors:
            yield full
            del full  # before the next tensor is synthesized

    record = FolderRecord("posthoc", sigma_rel=sigma_rel, until=step, provenance=description.provenance)
    progress = Progress("posthoc", quiet=True) if progress is None else progress
    with progress:
        counted = progress.counted(values(), sum(entry.nbytes for entry in entries))
        path = write_model(out, entries, counted, record, options.max_bytes, options.dtype)
    return path, sum(len(entry.names) for entry in entries)


def synthesized_dtype(entry: TensorEntry) -> torch.dtype:
    """The dtype a tensor is synthesized in: averaged ones summed in fp32 at least (as the
    in-process shadows are), whatever the snapshots were stored in; others as stored."""
    saved = entry.torch_dtype
    return torch.promote_types(saved, torch.float32) if entry.role == "average" else saved
