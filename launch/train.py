"""The main job: train a small byte-level GPT on real text under any engine, with shardavg averages.

    torchrun --nproc_per_node 2 -m launch.train --config configs/fsdp2.yaml [--out runs/fsdp2]

Every ``eval.every`` steps it evaluates the raw and every averaged model on held-out text (the
averages through ``swapped()``, shard-local) and appends both to ``OUT/metrics.jsonl``; every
``checkpoint.every`` steps it checkpoints everything under ``OUT/checkpoints/`` (``--resume``
continues from the newest, bitwise); at the end it exports each average (and the raw weights)
to ``OUT/export/NAME/`` as safetensors, draws ``OUT/plot.png`` and logs a summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from launch import checkpoints, data, engines, merging, rundir
from launch import config as configs
from launch.job import Job, load_job
from launch.model import GPT, Block, GPTConfig
from launch.progress import Progress
from shardavg import PostHocEMA, WeightAverager
from shardavg.integrations import Verdict

log = logging.getLogger("train")

# ----------------------------------------------------------------------------- configuration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/fsdp2.yaml", help="a YAML file from configs/")
    parser.add_argument("--out", help="output folder (default: runs/<config name>)")
    parser.add_argument("--steps", type=int, help="total optimizer steps (overrides the config's steps)")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in OUT that validates"
    )
    parser.add_argument("--resume-from", metavar="CHECKPOINT", help="continue from this checkpoint (a step-* folder)")
    parser.add_argument("--data", help="a text file or folder to train on instead of the standard library")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- training


def lr_at(step: int, cfg: dict) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` at the last step (a function of the step alone)."""
    train, steps = cfg["train"], cfg["steps"]
    if step <= train["warmup_steps"]:
        return train["lr"] * step / train["warmup_steps"]
    progress = (step - train["warmup_steps"]) / max(1, steps - train["warmup_steps"])
    return train["min_lr"] + (train["lr"] - train["min_lr"]) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def heldout_loss(wrapped: engines.Wrapped, batches: list) -> float:
    """Mean held-out loss over every data-parallel rank's share of the fixed evaluation set."""
    wrapped.model.eval()
    total = torch.zeros((), dtype=torch.float64)
    for tokens, targets in batches:
        total += wrapped.eval_loss(tokens, targets)
    dist.all_reduce(total)
    wrapped.model.train()
    return total.item() / (len(batches) * wrapped.data_world)


def evaluate(wrapped: engines.Wrapped, averages: dict[str, WeightAverager], batches: list) -> dict[str, float]:
    losses = {"raw": heldout_loss(wrapped, batches)}
    for name, average in averages.items():
        if average.num_updates:
            with average.swapped():
                losses[name] = heldout_loss(wrapped, batches)
    return losses


@dataclass
class Metrics:
    """``OUT/metrics.jsonl``, one JSON object per evaluation, written by rank 0."""

    path: Path

    def keep_until(self, step: int) -> None:
        """On resume: drop what a run wrote after the checkpoint it is resumed from."""
        if dist.get_rank() == 0 and self.path.exists():
            rows = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= step]
            self.path.write_text("".join(row + "\n" for row in rows))

    def append(self, row: dict) -> None:
        if dist.get_rank() == 0:
            with self.path.open("a") as file:
                file.write(json.dumps(row) + "\n")

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []


def plot(rows: list[dict], path: Path, title: str, merged: dict | None) -> None:
    """Held-out loss over steps: the raw weights and each average; the merge of the last
    checkpoints as a bar over the steps it averages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name in rows[-1]["heldout"]:
        points = [(row["step"], row["heldout"][name]) for row in rows if name in row["heldout"]]
        axes.plot(*zip(*points), label=name, linewidth=2 if name == "raw" else 1.6, marker="o", markersize=2.5)
    if merged is not None:
        steps = merged["steps"]
        label = f"{merged['name']} (steps {steps[0]}-{steps[-1]})"
        axes.plot([steps[0], steps[-1]], [merged["heldout"]] * 2, label=label, linewidth=2.5, marker="*", markersize=8)
    axes.set_xlabel("step")
    axes.set_ylabel("held-out loss (nats per byte)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


# ----------------------------------------------------------------------------- the job


@dataclass
class Run:
    """What a launch trains: the engine-wrapped model, its averages and post-hoc profiles, the
    evaluation set, the record of the held-out losses, and the checkpoints."""

    job: Job
    wrapped: engines.Wrapped
    averages: dict[str, WeightAverager]
    posthoc: PostHocEMA | None
    evaluation: list
    metrics: Metrics
    params: int
    checkpointer: checkpoints.Checkpointer
    start: int = 0  # the step training goes on from


def run(job: Job) -> dict:
    """Build, resume (with --resume), train, then export and report."""
    current = build(job)
    resume(current)
    clock, training_time, wall = train_steps(current)
    return finish(current, clock, training_time, wall)


def build(job: Job) -> Run:
    """The model wrapped by the engine, its averages and post-hoc profiles, the evaluation set."""
    cfg, out = job.cfg, job.out
    torch.manual_seed(cfg["seed"])
    model_config = GPTConfig(**cfg["model"])
    corpus = job.corpus
    log.info(
        "data: %s, %d train / %d held-out files, %.1f MB / %.1f MB",
        corpus.source,
        *corpus.files,
        len(corpus.train) / 1e6,
        len(corpus.heldout) / 1e6,
    )
    train = cfg["train"]

    def optimizer(params):
        return torch.optim.AdamW(params, lr=train["lr"], weight_decay=train["weight_decay"], betas=(0.9, 0.95))

    ds_config = (job.deepspeed_config or {}) | {
        "train_micro_batch_size_per_gpu": train["batch_size"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": train["grad_clip"],
    }
    gpt = GPT(model_config)
    params = sum(p.numel() for p in gpt.parameters())
    wrapped = engines.wrap(
        cfg["engine"], gpt, Block, getattr(torch, cfg["dtype"]), ds_config, optimizer, cfg["hsdp"]["replicas"],
        cfg["parallel"],
    )  # fmt: skip
    options = wrapped.averager_options | {"background": cfg["averaging"]["background"]}  # (a pipeline's group)
    averages = {name: WeightAverager(wrapped.model, rule, **options) for name, rule in job.rules.items()}
    log.info(
        "model: %.2fM parameters, %s on %d processes; averages: %s",
        params / 1e6,
        cfg["engine"],
        dist.get_world_size(),
        ", ".join(f"{n} = {a.rule!r}" for n, a in averages.items()),
    )
    posthoc = None
    if cfg["posthoc"]["snapshot_every"]:
        posthoc = PostHocEMA(
            wrapped.model,
            tuple(cfg["posthoc"]["sigma_rels"]),
            snapshot_every=cfg["posthoc"]["snapshot_every"],
            directory=out / "posthoc",
            **options,
        )
    evaluation = data.heldout_batches(
        corpus.heldout, wrapped.data_rank, wrapped.data_world, cfg["eval"]["batches"], train["batch_size"],
        model_config.context,
    )  # fmt: skip
    checkpointed = averages | ({"posthoc": posthoc} if posthoc else {})  # (PostHocEMA checkpoints like an averager)
    checkpointer = checkpoints.Checkpointer(
        out / "checkpoints", wrapped, checkpointed, cfg["checkpoint"]["keep_last"], cfg["checkpoint"]["async"]
    )
    return Run(job, wrapped, averages, posthoc, evaluation, Metrics(out / "metrics.jsonl"), params, checkpointer)


def resume(current: Run) -> None:
    """Restore everything from ``--resume``'s checkpoint; a fresh run starts a fresh record."""
    job = current.job
    if job.resume_from is not None:
        current.start = checkpoints.load(job.resume_from, current.wrapped, current.checkpointer.averages)
        current.metrics.keep_until(current.start)
        log.info("resumed from %s (step %d)", job.resume_from, current.start)
    elif current.metrics.path.exists() and dist.get_rank() == 0:
        current.metrics.path.unlink()


def train_steps(current: Run) -> tuple[UpdateClock, float, float]:
    """The training loop: a step, every average's update, evaluations and checkpoints as the
    config says. Returns the update clock, the seconds spent in training steps, the wall time."""
    cfg, wrapped = current.job.cfg, current.wrapped
    train, context = cfg["train"], cfg["model"]["context"]
    tokens_per_step = train["batch_size"] * context * wrapped.data_world
    start = current.start
    shown = Progress(cfg["steps"], start, cfg["engine"], sys.stderr, enabled=dist.get_rank() == 0)  # (a bar on a tty)
    began, training_time = time.perf_counter(), 0.0
    updated = current.averages | ({"posthoc": current.posthoc} if current.posthoc is not None else {})
    clock = UpdateClock(dict.fromkeys(updated, 0.0))  # (every step, in this order)
    with shown.redirect_logging():
        for step in range(start + 1, cfg["steps"] + 1):
            tokens, targets = data.train_batch(
                current.job.corpus.train, step, wrapped.data_rank, train["batch_size"], context, cfg["seed"]
            )
            step_began = time.perf_counter()
            loss, finite = wrapped.train_step(tokens, targets, lr_at(step, cfg), train["grad_clip"])
            for name, average in updated.items():
                clock.update(name, average, step, finite)
            training_time += time.perf_counter() - step_began
            shown.step(step, loss, tokens_per_step * (step - start) / training_time)
            if step % cfg["eval"]["every"] == 0 or step == cfg["steps"]:
                losses = evaluate(wrapped, current.averages, current.evaluation)
                current.metrics.append(
                    {"step": step, "tokens": step * tokens_per_step, "train_loss": loss, "lr": lr_at(step, cfg),
                     "heldout": losses}
                )  # fmt: skip
                log.info("step %d: held-out %s", step, ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))
            if step % cfg["checkpoint"]["every"] == 0 or step == cfg["steps"]:
                current.checkpointer.save(step)
    shown.close()
    current.checkpointer.close()  # (the last request committed before anything reads the checkpoints)
    return clock, training_time, time.perf_counter() - began


def finish(current: Run, clock: UpdateClock, training_time: float, wall: float) -> dict:
    """Merge the newest checkpoints (``merge.last``), export the raw weights and every average,
    sweep the post-hoc EMA, plot, and write the summary."""
    cfg, out, wrapped, averages = current.job.cfg, current.job.out, current.wrapped, current.averages
    merged = merge_last(current) if current.job.merge_last else None
    first = next(iter(averages.values()))
    exported = {"raw": str(first.export(out / "export" / "raw", live=True))}  # (any averager gathers the live weights)
    for name, average in averages.items():
        exported[name] = str(average.export(out / "export" / name))
    posthoc = current.posthoc
    sweep = posthoc_sweep(posthoc, wrapped, current.evaluation, cfg["posthoc"]["sweep"], out) if posthoc else None
    if sweep is not None and sweep["best"] is not None:
        exported["posthoc"] = str(out / "export" / "posthoc")
    if merged is not None:
        exported[merged["name"]] = str(out / "export" / merged["name"])
    shadow = torch.tensor([a.shadow_bytes() for a in averages.values()])
    dist.all_reduce(shadow, op=dist.ReduceOp.MAX)
    rows = current.metrics.rows() if dist.get_rank() == 0 else []
    tokens_per_step = cfg["train"]["batch_size"] * cfg["model"]["context"] * wrapped.data_world
    summary = {
        "engine": cfg["engine"],
        "processes": dist.get_world_size(),
        "steps": cfg["steps"],
        "resumed_from": current.start,
        "heldout": (rows[-1]["heldout"] if rows else {}) | ({merged["name"]: merged["heldout"]} if merged else {}),
        "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens_per_step * (cfg["steps"] - current.start) / training_time)
        if training_time
        else None,
        "shadow_bytes_per_rank": dict(zip(averages, shadow.tolist())),
        "update_share_of_step": clock.shares(training_time),
        "export": exported,
        "posthoc": sweep,
        "merge": merged,
        "checkpoints": current.checkpointer.report(),
    }
    if dist.get_rank() == 0:
        report(current, summary, sweep, rows)
    return summary


def report(current: Run, summary: dict, sweep: dict | None, rows: list[dict]) -> None:
    """Rank 0: the plots, ``summary.json`` and the log lines a person reads."""
    cfg, out = current.job.cfg, current.job.out
    title = f"{cfg['engine']}, {dist.get_world_size()} processes, {current.params / 1e6:.2f}M parameters"
    plot(rows, out / "plot.png", title, summary["merge"])
    if sweep is not None:
        plot_posthoc(sweep, summary["heldout"], out / "posthoc.png", cfg)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    final = summary["heldout"]
    log.info("held-out loss at step %d: %s", cfg["steps"], ", ".join(f"{k} {v:.4f}" for k, v in final.items()))
    log.info(
        "wall time %.1f s, %s tokens/s in training steps; shadows per rank: %s",
        summary["wall_s"],
        summary["tokens_per_s"],
        ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in summary["shadow_bytes_per_rank"].items()),
    )
    shares = summary["update_share_of_step"]
    log.info(
        "averaging took %.1f%% of the training steps' time (%s)",
        100 * shares["all"],
        ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items() if k != "all"),
    )
    saved = summary["checkpoints"]
    log.info(
        "checkpoints (%s): the training loop was blocked %.2f s by %d saves (%.3f s each), then %.2f s waiting for "
        "the last one",
        saved["mode"],
        saved["blocking_s"],
        saved["saves"],
        saved["blocking_s"] / max(saved["saves"], 1),
        saved["final_wait_s"],
    )
    log.info("wrote %s, %s and %s/", current.metrics.path, out / "plot.png", out / "export")


def merge_last(current: Run) -> dict:
    """Collective: the average of the newest ``merge.last`` checkpoints (or as many as the run has,
    for a shipped config's default: ``Job.merge_last``), evaluated on the held-out text and
    exported; what the summary records of it."""
    out, wrapped = current.job.out, current.wrapped
    merged = merging.merge_last(out, current.job.merge_last, wrapped)
    with merged.average.swapped():
        loss = heldout_loss(wrapped, current.evaluation)
    merged.average.export(out / "export" / merged.name)
    return {"name": merged.name, "steps": merged.steps, "heldout": loss}


@dataclass
class UpdateClock:
    """Seconds each average's ``update()`` took (the post-hoc profiles' with their snapshots), to
    report what averaging costs the training step."""

    seconds: dict[str, float]
    waited: dict[str, float] = field(default_factory=dict)  # each background's waits counted so far

    def update(self, name: str, average: WeightAverager | PostHocEMA, step: int, finite: Verdict) -> None:
        """Time ``update()`` with the step's verdict (``finite``); in the background
        (``averaging.background``), also the time the loop was blocked collecting the previous update
        since (at the optimizer step, by a reader)."""
        background = (average.averager if isinstance(average, PostHocEMA) else average).updater.background
        if background is not None:
            self.seconds[name] += background.waited_seconds - self.waited.get(name, 0.0)
        began = time.perf_counter()
        average.update(step, finite=finite)
        self.seconds[name] += time.perf_counter() - began
        if background is not None:
            self.waited[name] = background.waited_seconds

    def shares(self, step_seconds: float) -> dict[str, float]:
        """Collective: each one's share of the time in training steps, and all of them together,
        on the slowest rank."""
        seconds = torch.tensor([*self.seconds.values(), sum(self.seconds.values())], dtype=torch.float64)
        seconds /= max(step_seconds, 1e-9)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return {name: round(share, 5) for name, share in zip([*self.seconds, "all"], seconds.tolist())}


def posthoc_sweep(posthoc: PostHocEMA, wrapped: engines.Wrapped, batches: list, sigmas: list, out: Path) -> dict:
    """Synthesize each sigma_rel of the sweep from the snapshots (shard-local), take its held-out
    loss, and export the best; sigma_rel values the snapshots cannot fit are recorded as such."""
    losses: dict[str, float] = {}
    skipped: dict[str, str] = {}
    best = None
    if not any(posthoc.directory.glob("snapshot-*")):  # a run shorter than snapshot_every
        log.warning(
            "post-hoc sweep skipped: no snapshot in %s (posthoc.snapshot_every is larger than the run)",
            posthoc.directory,
        )
        return {"heldout": losses, "skipped": {str(s): "no snapshot" for s in sigmas}, "best": None}
    for sigma in sigmas:
        try:
            average = posthoc.synthesize(sigma)
        except ValueError as error:
            skipped[str(sigma)] = str(error).split(":")[0]
            continue
        with average.swapped():
            losses[str(sigma)] = heldout_loss(wrapped, batches)
        if best is None or losses[str(sigma)] < losses[best[0]]:
            best = (str(sigma), average)
    if best is not None:
        best[1].export(out / "export" / "posthoc")
    log.info("post-hoc sweep: %s", ", ".join(f"sigma_rel {k}: {v:.4f}" for k, v in losses.items()) or "nothing fit")
    return {"heldout": losses, "skipped": skipped, "best": None if best is None else float(best[0])}


def plot_posthoc(sweep: dict, final: dict, path: Path, cfg: dict) -> None:
    """Held-out loss against sigma_rel of the post-hoc synthesized EMAs (EDM2's figure), with the
    run's own averages and raw weights as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    points = sorted((float(k), v) for k, v in sweep["heldout"].items())
    if points:
        axes.plot(*zip(*points), marker="o", linewidth=2, label="post-hoc EMA, synthesized")
    for (name, loss), color in zip(final.items(), ("grey", "tab:orange", "tab:red", "tab:purple", "tab:brown")):
        label = name if name == "raw" else f"{name} ({'merged checkpoints' if name.startswith('merge-') else 'kept'})"
        axes.axhline(loss, linestyle="--", linewidth=1, color=color, label=label)
    if sweep["best"] is not None:
        axes.axvline(sweep["best"], color="green", alpha=0.4, label=f"best sigma_rel {sweep['best']:g}")
    profiles = ", ".join(f"{s:g}" for s in cfg["posthoc"]["sigma_rels"])
    axes.set_xlabel("sigma_rel")
    axes.set_ylabel("held-out loss (nats per byte)")
    axes.set_title(f"post-hoc EMA from profiles {profiles}, {cfg['engine']}, step {cfg['steps']}")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


CONFIG_ERROR_GRACE = 2.0  # seconds the other ranks give rank 0 to report a config error first


def report_config_error(message: str, rank: int) -> None:
    """Every rank found the same error before any process group exists, so none can wait for
    another: rank 0 says it at once; the others say it only after a grace period, which they
    normally do not live through (torchrun stops them once rank 0 exits). Either way the
    message is shown, even when rank 0 is the one torchrun stops first; and mostly once."""
    if rank != 0:
        time.sleep(CONFIG_ERROR_GRACE)
    log.error("config error: %s", message)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    try:
        job = load_job(args, world)
    except configs.ConfigError as error:
        report_config_error(str(error), rank)
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engines.init_distributed(job.cfg["engine"])
    try:
        with rundir.locked(job.out):
            run(job)
            dist.barrier()  # every rank done before any leaves
    except (rundir.RunRefused, checkpoints.Unreadable, merging.MergeFailed) as error:  # raised on every rank alike
        if rank == 0:
            log.error("error: %s", error)
        dist.barrier()  # rank 0 has said why before any rank leaves (torchrun stops the others then)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # without the interpreter's teardown, where gloo's C++ threads now and then abort
