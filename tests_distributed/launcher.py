"""Run a scenario under torchrun with a hard timeout, and read back what it reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the repository: the packages launch (the main job) and tools import from here


@dataclass
class Launch:
    returncode: int
    output: str

    def reports(self, kind: str) -> list[dict]:
        """The JSON payloads of ``SHARDAVG_<kind>`` lines (other ranks' output may share the line)."""
        marker, decoder, found = f"SHARDAVG_{kind} ", json.JSONDecoder(), []
        for line in self.output.splitlines():
            start = line.find(marker)
            if start >= 0:
                found.append(decoder.raw_decode(line, start + len(marker))[0])
        return found


def one_build_of_deepspeeds_op(env: dict) -> dict[str, str]:
    """What makes every process of both test tiers, in-process tests and launched ranks alike,
    find the one build of DeepSpeed's CPU op (compiled on its first use, ~1 minute of a core
    per source file) instead of building it again.

    The build goes inside this environment, where no other environment's build (and its lock
    file) can stall a launch; and ``ninja`` is this environment's, whether it is activated or
    not: ninja records each build's command and rebuilds when another ninja (another version)
    finds a command it hashes differently, so a tier run with another ``ninja`` on ``PATH``
    compiled the op again."""
    bin_dir = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    return {
        "TORCH_EXTENSIONS_DIR": env.get("TORCH_EXTENSIONS_DIR") or str(Path(sys.prefix) / "torch_extensions"),
        "PATH": path if path.split(os.pathsep)[:1] == [bin_dir] else os.pathsep.join(filter(None, [bin_dir, path])),
    }


# What a rank that builds a ZeRO engine imports inside ``deepspeed.initialize``: DeepSpeed 0.19's
# check for its Muon optimizer imports a module that compiles at import (2.5 s a process). A
# launch that builds ZeRO engines names it as ``preload``, and its ranks are forked after it.
ZERO = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer")


def torchrun(
    script: str,
    nproc: int,
    *args: str,
    timeout: float = 300,
    env: dict | None = None,
    forked: bool = True,
    preload: tuple[str, ...] = (),
) -> Launch:
    """Launch ``script`` (a name in this folder, a path, or a module as ``"-m launch.train"``) on
    ``nproc`` ranks through torchrun's launcher; on timeout kill the whole process group and fail.

    ``forked=False`` runs the ``torchrun`` command itself, whose report names every rank that
    failed: a test that kills a rank and looks for the signal in the report needs it (with forked
    ranks the agent reports the first failure it sees, which may be the peer the kill cut off).
    ``preload``: modules the ranks import later, imported before they are forked (``ZERO``)."""
    target = ["-m", script.removeprefix("-m ")] if script.startswith("-m ") else [str(HERE / script)]
    if not forked or os.environ.get("SHARDAVG_TEST_LAUNCHER") == "torchrun":  # every rank imports for itself
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:  # torchrun's launcher with ranks forked after the script's imports (forked_launch.py says why)
        command = [sys.executable, str(HERE / "forked_launch.py"), str(nproc)]
        command += [f"--preload={','.join(preload)}"] if preload else []
    command += [*target, *args]
    # (a rank that crashes in C++ prints where it was, Python frames included)
    quiet = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    env = os.environ | quiet | (env or {})
    # (scenarios elsewhere, tests_gpu/'s, import the harness here; the main job and the tools, their packages)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(ROOT), env.get("PYTHONPATH")]))
    env |= one_build_of_deepspeeds_op(env)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{script} on {nproc} ranks timed out after {timeout}s:\n{output[-20000:]}") from None
    return Launch(process.returncode, output)
