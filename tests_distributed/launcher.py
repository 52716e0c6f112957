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


def torchrun(script: str, nproc: int, *args: str, timeout: float = 300, env: dict | None = None) -> Launch:
    """Launch ``script`` (a name in this folder, a path, or a module as ``"-m launch.train"``) on
    ``nproc`` ranks; on timeout kill the whole process group and fail."""
    target = ["-m", script.removeprefix("-m ")] if script.startswith("-m ") else [str(HERE / script)]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target, *args,
    ]  # fmt: skip
    # (a rank that crashes in C++ prints where it was, Python frames included)
    quiet = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    env = os.environ | quiet | (env or {})
    # (scenarios elsewhere, tests_gpu/'s, import the harness here; the main job and the tools, their packages)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(ROOT), env.get("PYTHONPATH")]))
    # DeepSpeed compiles a small op on first use; build it inside this environment, where no
    # other environment's half-finished build (and its lock file) can stall the launch.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
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
