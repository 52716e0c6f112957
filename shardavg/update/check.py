"""The non-finite check of one averager: when the loop's verdict may stand in for the screen.

The screen reads every local shard for NaN and infinity (one more read of every live byte). The
loop's verdict (``update(finite=...)``: the total gradient norm, or False for a step its
optimizer skipped) is free, but it proves less: with finite gradients a torch optimizer moves
each weight by a finite amount, so a true verdict says the weights are finite *if they were
before the step*. A false one proves nothing about them: a loss scaler's overflow leaves them
as they were, but ``clip_grad_norm_`` scales infinite gradients by 1/inf = 0, inf * 0 is NaN,
and the optimizer writes it. So trust is earned by a screen and lost by anything the verdicts
did not see, and a false verdict is screened at its own step.

Like ``torch.amp.GradScaler``'s per-optimizer state, this object holds that trust and nothing
else: the ``Updater`` tells it each step's verdict and what each screen found, and it says what
the update does. It reads no tensor. The states:

- **untrusted** (built, restored, ...): the next update is screened;
- **trusted through update n**: a true verdict stands in for the screen up to the n-th due
  update (``ordinal``), n = the last clean screen's + ``screen_every`` - 1;
- on the device path only, **unvouched**: the device's own flag (``vouched``), mirrored here,
  says a verdict issued there was false and no screen has found the weights finite since; it
  masks every update the device runs until one does (the host learns of a false verdict only
  when it reads it, ``settled``, by which time later updates may have been issued unscreened).

=====================================================  ===========================  ===========================
event                                                  the update                   then
=====================================================  ===========================  ===========================
averager built, ``load``/``load_state_dict``/          (none)                       untrusted
``restart``, ``copy_into_model``, new live tensors,
a jump in ``step``
due update, no verdict                                 screened; applied if clean   trusted if clean, else
                                                                                    untrusted
due update, true verdict, trusted                      applied, no screen           unchanged
due update, true verdict, untrusted or past n          screened; applied if clean   trusted if clean, else
                                                                                    untrusted
due update, false verdict                              skipped; screened at once    trusted if clean, else
                                                       (``on_nonfinite`` applies    untrusted
                                                       to what it finds)
step between updates, true verdict                     (none)                       unchanged
step between updates, false verdict                    screened at once             trusted if clean, else
                                                                                    untrusted
step between updates, no verdict or one on a device    (none)                       untrusted
screen found NaN or infinity                           ``"raise"`` raises,          untrusted: the screen runs
                                                       ``"skip"`` warns, skipped    at every update until clean
device path: a false verdict read (``settled``)        skipped                      untrusted; unvouched unless
                                                                                    screened clean at its step
device path: an update issued while unvouched          masked there: skipped        unchanged
``on_nonfinite="off"``                                 no screen; a false verdict   (no trust kept)
                                                       skips silently
=====================================================  ===========================  ===========================

A run whose skips are healthy (a loss scaler's overflows: finite weights) pays one screen per
skipped step and nothing on the others; one whose weights the optimizer made non-finite raises
(``"raise"``) at the step that wrote them, or skips every update until they are finite again
(``"skip"``), each with its warning. Nothing non-finite enters the average unseen, except what
a verdict cannot see (a write outside the optimizer) within ``screen_every`` updates.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from .options import Options

Settled = Literal["applied", "refused", "nonfinite", "unvouched"]


class Decision(NamedTuple):
    """What one update does about the check: ``screen`` the local shards first, and ``apply`` it
    (False: the loop's verdict was false; the update is skipped, whatever the screen finds)."""

    screen: bool
    apply: bool


# The four decisions, made once: a trusted update decides without building anything (see
# ``Updater``: its trusted path makes no call the unchecked update does not make).
APPLY = Decision(screen=False, apply=True)
SCREEN = Decision(screen=True, apply=True)
SCREEN_AND_SKIP = Decision(screen=True, apply=False)
SKIP = Decision(screen=False, apply=False)


class NonFiniteCheck:
    """The trust the loop's verdicts have earned, and the screen schedule it implies (see the table
    above). ``ordinal`` counts the due updates decided so far; ``trusted_until`` is the last one a
    true verdict may stand in for; ``trust_from`` the first whose clean screen may extend that (a
    screen issued on a device before ``distrust`` and read after it vouches for nothing);
    ``vouched`` mirrors the device's flag; ``unvouched_at`` is the step whose false verdict
    cleared it."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.ordinal = self.trusted_until = self.trust_from = 0
        self.vouched = True
        self.unvouched_at: int | None = None
        self.distrust()

    # ------------------------------------------------------------------ what the update does

    def due(self, verdict: bool | torch.Tensor | None) -> Decision:
        """Decide the next due update, given the loop's ``verdict`` on its step: None (none), a
        bool (read on the host) or a tensor left on a device (masking the update there, unread)."""
        self.ordinal += 1
        if self.options.on_nonfinite == "off":
            return SKIP if verdict is False else APPLY
        if verdict is False:
            return SCREEN_AND_SKIP
        if verdict is None or self.ordinal > self.trusted_until:
            return SCREEN
        return APPLY

    def between(self, verdict: bool | torch.Tensor | None) -> bool:
        """A step no update is due at, with the loop's ``verdict`` on it: whether to screen now (a
        false one read on the host). One the host cannot read, or none, leaves the weights unseen:
        the next update screens."""
        if self.options.on_nonfinite == "off" or verdict is True:
            return False
        if verdict is False:
            return True
        self.distrust()
        return False

    def stepped(self, previous: int, step: int) -> None:
        """``step`` taken after ``previous``: steps the loop took without a word to us were not seen."""
        if step != previous + 1:
            self.distrust()

    # ------------------------------------------------------------------ what the screens found

    def screened(self, clean: bool, ordinal: int | None = None) -> None:
        """A screen of update ``ordinal`` (None: the latest decided) found every local shard
        finite (``clean``), or not: trust for ``screen_every`` updates from it, or none."""
        ordinal = self.ordinal if ordinal is None else ordinal
        if not clean:
            self.distrust()
        elif ordinal >= self.trust_from:
            self.trusted_until = max(self.trusted_until, ordinal + self.options.screen_every - 1)

    def settled(self, step: int, ordinal: int, screened_clean: bool | None, refused: bool) -> Settled:
        """An update issued on the device read back (in order): its screen's word (None: not
        screened), and whether its verdict was false (``refused``). Mirrors the device's ``vouched``
        flag (``Updater._apply_on_device``: the update applied where its verdict, and its screen or
        else the flag, say so; the flag then its screen's word, or else itself and the verdict) and
        says what became of the update."""
        if self.options.on_nonfinite == "off":  # (the device masks by the verdict alone)
            return "refused" if refused else "applied"
        vouched = self.vouched if screened_clean is None else screened_clean
        if screened_clean is not None:
            self.screened(screened_clean, ordinal)
            self.vouched = screened_clean
        elif refused:  # (the weights after a false verdict, unscreened: nothing vouches for them)
            self.distrust()
            self.vouched, self.unvouched_at = False, step
        if screened_clean is False:
            return "nonfinite"
        if refused:
            return "refused"
        return "applied" if vouched else "unvouched"

    # ------------------------------------------------------------------ what makes trust stale

    def distrust(self) -> None:
        """From the next update on, the verdict stands in for the screen only once a screen run from
        then on has found every local shard finite."""
        self.trusted_until, self.trust_from = self.ordinal, self.ordinal + 1

    def restored(self) -> None:
        """The state was restored and the device's flags dropped (``Updater.forget``): untrusted,
        and vouched again (the next update is screened, and its screen sets the flag anew)."""
        self.vouched, self.unvouched_at = True, None
        self.distrust()
