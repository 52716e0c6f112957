"""What one launch of the main job runs: the config checked whole, and everything derived from it.

``load_job`` runs on every rank before any process group: anything that can be wrong (a key,
a number out of the range that works, the data, the run folder, a damaged checkpoint to resume
from) stops the job here with one message naming the key or the file, so a run never trains
for an hour to die at its end.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from launch import checkpoints, data, engines, rundir
from launch import config as configs
from launch.config import ConfigError
from shardavg.posthoc import target_gamma
from shardavg.rules import Rule, rule_from_config

log = logging.getLogger("train")

OPTIONAL_STR = (str, type(None))
SCHEMA = {
    "engine": str,  # ddp | fsdp1 | fsdp2 | hsdp | zero3 | fsdp2_tp | pp
    "seed": int,
    "steps": int,
    "dtype": str,  # of the live weights: float32 or bfloat16 (the averages stay fp32)
    "model": {"dim": int, "layers": int, "heads": int, "context": int},
    "data": {"path": OPTIONAL_STR, "heldout_fraction": float, "max_bytes": int},
    "train": {
        "batch_size": int,
        "lr": float,
        "min_lr": float,
        "warmup_steps": int,
        "weight_decay": float,
        "grad_clip": float,
    },
    "averages": dict,  # name -> a shardavg rule config, e.g. {kind: ema, decay: 0.999}
    "averaging": {"background": bool},  # background: each update() on a thread of its own (background=True)
    "eval": {"every": int, "batches": int},
    "posthoc": {"snapshot_every": int, "sigma_rels": list, "sweep": list},  # snapshot_every 0: off
    "checkpoint": {"every": int, "keep_last": int, "async": bool},  # async: DCP's async_save, one request in flight
    "merge": {"last": (int, type(None))},  # average the newest K checkpoints at the end; 0 or null: off
    "hsdp": {"replicas": (int, type(None))},  # null: one replica per node
    "parallel": {"tp": int, "pp": int, "microbatches": int},  # fsdp2_tp's tensor-parallel degree, pp's stages
    "deepspeed": OPTIONAL_STR,  # the DeepSpeed JSON config (zero3 only), relative to the YAML file
}

# The range of every integer key: (smallest, largest, why the largest).
BIG = 2**31 - 1
INTS = {
    "seed": (0, 2**32 - 1, "a 32-bit seed (batches are drawn from seed * 1,000,003 + step * 4,099 + rank)"),
    "steps": (1, 10**8 - 1, "checkpoint folders number steps in 8 digits"),
    "model.dim": (1, 2**16, "a sane width"),
    "model.layers": (1, 2**10, "a sane depth"),
    "model.heads": (1, 2**16, "at most the width"),
    "model.context": (1, 2**20, "a sane window"),
    "data.max_bytes": (1, 2**40, "1 TiB"),
    "train.batch_size": (1, 2**20, "a sane batch"),
    "train.warmup_steps": (0, BIG, "a 32-bit count"),
    "eval.every": (1, BIG, "a 32-bit count"),
    "eval.batches": (1, 2**20, "a sane count"),
    "posthoc.snapshot_every": (0, BIG, "a 32-bit count (0: off)"),
    "checkpoint.every": (1, BIG, "a 32-bit count"),
    "checkpoint.keep_last": (1, 2**20, "a sane count"),
    "merge.last": (0, 2**20, "a sane count (0 or null: off)"),
    "parallel.tp": (1, 2**10, "a sane degree"),
    "parallel.pp": (1, 2**10, "a sane number of stages"),
    "parallel.microbatches": (1, 2**20, "a sane count"),
}
# The range of every float key: a finite number with a lower bound, open or closed.
FLOATS = {
    "train.lr": (0.0, False),
    "train.min_lr": (0.0, True),
    "train.weight_decay": (0.0, True),
    "train.grad_clip": (0.0, False),
}
MEMORY_SHARE = 0.8  # of this machine's memory the training step may need, split across its processes
SHIPPED = Path(__file__).resolve().parents[1] / "configs"  # the configs this repository ships


@dataclass
class Job:
    """What one launch runs: the validated config and what was derived from it."""

    cfg: dict
    rules: dict[str, Rule]  # one average per name
    out: Path
    resume_from: Path | None  # the newest finished checkpoint that validates, with --resume
    deepspeed_config: dict | None  # zero3 only
    corpus: data.Corpus
    merge_last: int  # how many checkpoints the run merges at its end (0: none), at most 'merge.last'


def load_job(args: argparse.Namespace, world: int) -> Job:
    """The validated job: everything that can be wrong is found here, before any process group or training."""
    overrides = list(args.set)
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    cfg = configs.load(args.config, overrides)
    if args.data is not None:
        cfg.setdefault("data", {})["path"] = args.data
    configs.validate(cfg, SCHEMA)
    if cfg["engine"] not in engines.ENGINES:
        raise ConfigError(f"config key 'engine': {cfg['engine']!r} is not one of {engines.ENGINES}")
    if cfg["dtype"] not in ("float32", "bfloat16"):
        raise ConfigError(f"config key 'dtype': {cfg['dtype']!r} is not float32 or bfloat16")
    _check_numbers(cfg)
    rules = _rules(cfg["averages"])
    _check_posthoc(cfg["posthoc"])
    deepspeed_config = _check_engine_fits(cfg, Path(args.config), world)
    _check_memory(cfg, world)
    if cfg["data"]["path"] is not None and not Path(cfg["data"]["path"]).exists():
        raise ConfigError(f"config key 'data.path': {cfg['data']['path']} does not exist")
    out = Path(args.out or Path("runs") / Path(args.config).stem)
    resume_from = _resume_from(args, out, cfg["engine"])
    merge_last = plan_merge(cfg, out / "checkpoints", resume_from, required=merge_is_required(args))
    rundir.check_out(out, resuming=resume_from is not None)
    corpus = _corpus(cfg)
    return Job(cfg, rules, out, resume_from, deepspeed_config, corpus, merge_last)


def _value(cfg: dict, key: str):
    section, _, name = key.rpartition(".")
    return (cfg[section] if section else cfg)[name]


def _check_numbers(cfg: dict) -> None:
    """Every integer in its range, every float finite in its own, and what ties them together."""
    for key, (low, high, why) in INTS.items():
        if _value(cfg, key) is not None and not low <= _value(cfg, key) <= high:
            least = "at least 1" if low == 1 else f"from {low}"
            raise ConfigError(
                f"config key {key!r} must be {least} and at most {high:,} ({why}), got {_value(cfg, key)}"
            )
    for key, (low, closed) in FLOATS.items():
        value = _value(cfg, key)
        if not (math.isfinite(value) and (value >= low if closed else value > low)):
            bound = f">= {low}" if closed else f"> {low}"
            raise ConfigError(f"config key {key!r} must be a finite number {bound}, got {value}")
    if cfg["train"]["min_lr"] > cfg["train"]["lr"]:
        raise ConfigError(f"config key 'train.min_lr' ({cfg['train']['min_lr']}) must not exceed 'train.lr'")
    fraction = cfg["data"]["heldout_fraction"]
    if not 0 < fraction < 1:  # (NaN fails too)
        raise ConfigError(f"config key 'data.heldout_fraction' must be between 0 and 1, got {fraction}")
    model = cfg["model"]
    if model["dim"] % model["heads"]:
        raise ConfigError(f"config key 'model.heads' ({model['heads']}) must divide 'model.dim' ({model['dim']})")


def _check_memory(cfg: dict, world: int) -> None:
    """Refuse a model or batch whose training step cannot fit in this machine's memory: the
    attention scores (batch x heads x context**2, kept for the backward pass) and the activations
    (about 24 floats per batch x context x width per layer), with the model and its optimizer."""
    model, batch = cfg["model"], cfg["train"]["batch_size"]
    per_layer = 4 * batch * (model["heads"] * model["context"] ** 2 + 24 * model["context"] * model["dim"])
    weights = 16 * (12 * model["layers"] * model["dim"] ** 2 + (256 + model["context"]) * model["dim"])
    needed = model["layers"] * per_layer + weights
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MEMORY_SHARE / processes
    if needed > available:
        raise ConfigError(
            f"config keys 'model.context' ({model['context']}), 'model.dim' ({model['dim']}), 'model.layers' "
            f"({model['layers']}), 'model.heads' ({model['heads']}) and 'train.batch_size' ({batch}) need about "
            f"{needed / 2**30:,.1f} GiB per process, more than this machine's {available / 2**30:,.1f} GiB for each "
            f"of its {processes} processes: make them smaller"
        )


def _check_posthoc(posthoc: dict) -> None:
    for key in ("sigma_rels", "sweep"):
        values = posthoc[key]
        if not values:
            raise ConfigError(f"config key 'posthoc.{key}' must list sigma_rel values")
        for value in values:
            try:
                target_gamma(sigma_rel=value)
            except ValueError as error:
                raise ConfigError(f"config key 'posthoc.{key}': {error}") from None
    if posthoc["snapshot_every"] and len(posthoc["sigma_rels"]) < 2:
        raise ConfigError("config key 'posthoc.sigma_rels' needs at least two profiles")


def _rules(averages: dict) -> dict:
    if not averages:
        raise ConfigError("config key 'averages' must name at least one average")
    rules = {}
    for name, rule in averages.items():
        if not re.fullmatch(r"[a-z][a-z0-9_]*", str(name)) or name in ("raw", "posthoc"):
            raise ConfigError(
                f"config key 'averages.{name}': names are lower-case words other than 'raw' and 'posthoc'"
            )
        try:
            rules[name] = rule_from_config(rule)
        except (TypeError, ValueError, KeyError) as error:
            raise ConfigError(f"config key 'averages.{name}': {error}") from None
    return rules


def _check_engine_fits(cfg: dict, config_path: Path, world: int) -> dict | None:
    """The engine can run this launch; returns the DeepSpeed config for zero3."""
    engine = cfg["engine"]
    ds_config = None
    if engine == "zero3":
        if cfg["deepspeed"] is None:
            raise ConfigError("config key 'deepspeed': zero3 needs a DeepSpeed JSON config")
        path = config_path.parent / cfg["deepspeed"]
        try:
            ds_config = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"config key 'deepspeed': cannot read {path}: {error}") from None
        if not isinstance(ds_config, dict) or ds_config.get("zero_optimization", {}).get("stage") != 3:
            raise ConfigError(f"config key 'deepspeed': {path} does not set zero_optimization.stage 3")
    elif cfg["deepspeed"] is not None:
        raise ConfigError(f"config key 'deepspeed' is for the zero3 engine, not {engine}")
    _check_parallel(cfg, world)
    _check_checkpoints(cfg)
    replicas = cfg["hsdp"]["replicas"]
    if engine == "hsdp" and replicas is not None and (replicas < 1 or world % replicas):
        raise ConfigError(f"config key 'hsdp.replicas': {world} processes cannot form {replicas} replicas")
    if engine in ("fsdp1", "fsdp2", "hsdp", "zero3") and world == 1:
        log.warning("%s on one process shards nothing; launch with --nproc_per_node 2 or more", engine)
    return ds_config


def _check_checkpoints(cfg: dict) -> None:
    """What the engine's checkpoints allow: ZeRO-3's are DeepSpeed's own, saved by DeepSpeed in the
    loop, not by DCP (their merge: ``plan_merge``)."""
    if cfg["engine"] != "zero3":
        return
    if cfg["checkpoint"]["async"]:
        raise ConfigError(
            "config key 'checkpoint.async': the zero3 engine saves DeepSpeed's own checkpoints, which DCP cannot "
            "save asynchronously: set it to false"
        )


def merge_is_required(args: argparse.Namespace) -> bool:
    """Whether the user chose ``merge.last`` (with ``--set``, or in a YAML of their own): then a run
    that cannot give that many checkpoints is refused. A shipped config's value is a default sized
    for its full run, an upper bound, so that a smoke run of it works at any ``--steps``."""
    if any(override.partition("=")[0].strip() in ("merge", "merge.last") for override in args.set):
        return True
    return Path(args.config).resolve().parent != SHIPPED


def plan_merge(cfg: dict, root: Path, resume_from: Path | None, required: bool) -> int:
    """How many checkpoints the run merges at its end (``merge.last`` K; 0: none): K when it will
    end with at least K finished ones (a resumed run's kept ones up to its step, then those of the
    steps it saves at). With fewer, a K the user chose (``required``) is refused before anything
    runs; a shipped default merges what the run will have, saying so in one line."""
    last, keep_last = cfg["merge"]["last"], cfg["checkpoint"]["keep_last"]
    if not last:
        return 0
    if cfg["engine"] == "zero3":  # its checkpoints are DeepSpeed's own: nothing to merge
        why = "the zero3 engine's checkpoints are DeepSpeed's own, pickled states that shardavg merge never loads"
        if required:
            raise ConfigError(
                f"config key 'merge.last': {why}: set it to 0 (or merge the averages' checkpoints beside them offline)"
            )
        log.info("merge.last %d (the config's default): %s; no merge", last, why)
        return 0
    if required and last > keep_last:
        raise ConfigError(
            f"config key 'merge.last' ({last}) exceeds 'checkpoint.keep_last' ({keep_last}): keep at least as many "
            "checkpoints as it merges"
        )
    kept = _kept_steps(cfg, root, resume_from)
    if last <= len(kept):
        return last
    if required:
        raise ConfigError(
            f"config key 'merge.last' ({last}): the run will end with the checkpoints of steps {kept} only; lower it, "
            "or checkpoint more often ('checkpoint.every')"
        )
    if not kept:
        log.info("merge.last %d (the config's default): the run will end with no checkpoint; no merge", last)
        return 0
    steps = ", ".join(map(str, kept))
    if len(kept) == 1:
        found = f"1 checkpoint (step {steps}); merging that one"
    else:
        found = f"{len(kept)} checkpoints (steps {steps}); merging those"
    log.info("merge.last %d (the config's default): the run will end with %s", last, found)
    return len(kept)


def _kept_steps(cfg: dict, root: Path, resume_from: Path | None) -> list[int]:
    """The steps of the finished checkpoints the run will end with, oldest first (of those it saves,
    the newest ``merge.last`` at most: enough to count): a resumed run's kept ones up to its step,
    then those of the steps it saves at, the newest ``checkpoint.keep_last`` of them all."""
    last, keep_last = cfg["merge"]["last"], cfg["checkpoint"]["keep_last"]
    start = 0 if resume_from is None else json.loads((resume_from / checkpoints.MARKER).read_text())["step"]
    earlier = [checkpoints.step_of(p) for p in checkpoints.finished(root)]
    kept = [s for s in earlier if s <= start] + _saved_steps(start, cfg["steps"], cfg["checkpoint"]["every"], last)
    return kept[-keep_last:]


def _saved_steps(start: int, steps: int, every: int, limit: int) -> list[int]:
    """The newest ``limit`` steps a run from ``start`` to ``steps`` checkpoints at (every
    ``every`` steps and the last), oldest first."""
    found = [steps] if start < steps else []
    step = (steps - 1) // every * every
    while step > start and len(found) < limit:
        found.append(step)
        step -= every
    return found[::-1]


def _check_parallel(cfg: dict, world: int) -> None:
    """Tensor and pipeline parallel: degrees that divide the launch and the model."""
    engine, parallel, model = cfg["engine"], cfg["parallel"], cfg["model"]
    tp, pp, microbatches = parallel["tp"], parallel["pp"], parallel["microbatches"]
    if engine != "fsdp2_tp" and tp != 1:
        raise ConfigError(f"config key 'parallel.tp' is for the fsdp2_tp engine (1 otherwise), got {tp} for {engine}")
    if engine != "pp" and (pp, microbatches) != (1, 1):
        raise ConfigError("config keys 'parallel.pp' and 'parallel.microbatches' are for the pp engine (1 otherwise)")
    if engine == "fsdp2_tp":
        if world % tp:
            raise ConfigError(f"config key 'parallel.tp' ({tp}) must divide the {world} processes")
        if model["heads"] % tp:  # a column-wise shard of qkv must hold whole heads
            raise ConfigError(f"config key 'parallel.tp' ({tp}) must divide 'model.heads' ({model['heads']})")
    if engine == "pp":
        if pp < 2 or world % pp:
            raise ConfigError(f"config key 'parallel.pp' ({pp}) must be at least 2 and divide the {world} processes")
        if model["layers"] < pp:
            raise ConfigError(f"config key 'parallel.pp' ({pp}): 'model.layers' ({model['layers']}) cannot fill them")
        if cfg["train"]["batch_size"] % microbatches:
            raise ConfigError(
                f"config key 'parallel.microbatches' ({microbatches}) must divide 'train.batch_size' "
                f"({cfg['train']['batch_size']})"
            )


def _resume_from(args: argparse.Namespace, out: Path, engine: str) -> Path | None:
    """The checkpoint to resume from: ``--resume-from``'s if it validates, or with ``--resume`` the
    newest finished one in OUT that does (each one skipped is logged with why); a new run refuses
    an OUT holding an earlier run's checkpoints or snapshots."""
    if args.resume_from is not None:
        folder = Path(args.resume_from)
        if not (folder / checkpoints.MARKER).is_file():
            raise ConfigError(
                f"--resume-from {folder}: not a finished checkpoint of this job (no {checkpoints.MARKER})"
            )
        problem = checkpoints.problem(folder, engine)
        if problem:
            raise ConfigError(f"--resume-from {folder}: {problem}")
        return folder
    found = checkpoints.finished(out / "checkpoints")
    if not args.resume:
        if found:  # a new run would mix its checkpoints with these, and prune them
            raise ConfigError(
                f"{out} holds checkpoints of an earlier run (newest {found[-1].name}): --resume to continue it, "
                "or choose another --out"
            )
        snapshots = sorted(p.name for p in (out / "posthoc").glob("snapshot-*")) if (out / "posthoc").is_dir() else []
        if snapshots:
            raise ConfigError(
                f"{out / 'posthoc'} holds post-hoc snapshots of an earlier run ({snapshots[-1]}): --resume to "
                "continue it, or choose another --out"
            )
        return None
    if not found:
        raise ConfigError(f"--resume: no finished checkpoint under {out / 'checkpoints'}")
    skipped = []
    for folder in reversed(found):
        problem = checkpoints.problem(folder, engine)
        if problem is None:
            for name, why in skipped if os.environ.get("RANK", "0") == "0" else ():  # (every rank finds the same)
                log.warning("--resume: skipped %s, which cannot be resumed from: %s", name, why)
            return folder
        skipped.append((folder.name, problem))
    raise ConfigError(
        "--resume: no checkpoint under "
        f"{out / 'checkpoints'} can be resumed from: " + "; ".join(f"{name}: {why}" for name, why in skipped)
    )


def _corpus(cfg: dict) -> data.Corpus:
    """The text, read now so that a path, a file or a size that cannot serve stops the job here."""
    settings, context = cfg["data"], cfg["model"]["context"]
    try:
        return data.load_corpus(
            settings["path"], settings["heldout_fraction"], settings["max_bytes"], cfg["seed"], context
        )
    except (OSError, ValueError) as error:
        key = "data.path" if settings["path"] is not None else "data.max_bytes"
        raise ConfigError(f"config key {key!r} (with model.context {context}): {error}") from None
