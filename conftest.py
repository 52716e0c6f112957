"""Both test tiers, every test process and every rank they launch, use one build of DeepSpeed's
CPU op (tests_distributed/launcher.py says why): set here, before any test imports DeepSpeed."""

from __future__ import annotations

import os

from launcher import one_build_of_deepspeeds_op

os.environ.update(one_build_of_deepspeeds_op(os.environ))
