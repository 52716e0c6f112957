"""Integrations with the frameworks' own loops and checkpointing: ``accelerate`` (``save_state``/
``load_state`` hooks), ``deepspeed`` (an engine's ``save_checkpoint``/``load_checkpoint`` with the
average inside the tag), ``transformers`` (a Trainer callback) and ``lightning`` (a callback for
sharded strategies). Each imports its framework only when used; the rest of shardavg never does.
Each holds the averager (``shardavg.WeightAverager``, from ``averager/``).

Each also hands ``update(finite=...)`` the verdict its engine already has on the step just taken
(a skipped optimizer step, the total gradient norm), as ``Verdict``.

It may import: base, rules, checkpoints, output, averager.
"""

from __future__ import annotations

import math

import torch

Verdict = bool | torch.Tensor | None  # what ``WeightAverager.update(finite=...)`` takes; None: no verdict


def norm_verdict(norm: float | torch.Tensor | None) -> Verdict:
    """A total gradient norm as a verdict: a tensor as it is (on its device, never read here), a
    Python float (DeepSpeed keeps some as floats) as whether it is finite, None as no verdict."""
    return math.isfinite(norm) if isinstance(norm, float) else norm
