"""What ``shardavg merge`` holds in memory, against the number of checkpoints it averages.

    python -m tools.merge_memory [--model-mb 200] [--counts 1 2 4 8] [--dir /tmp/merge-memory]

Writes 8 Hugging Face safetensors checkpoints of a model of ``--model-mb`` MB (fp32 tensors of a
transformer's shapes, the largest an embedding), then merges the first N of them for each N of
``--counts``, each merge in a fresh process, and prints the peak resident memory that merge added
over what the process held before it (the kernel's peak resident size, ``VmHWM``, reset after the
imports; glibc's mmap threshold fixed, so that a freed tensor leaves at once), beside the model's
size and its largest tensor.
Streaming tensor by tensor, the peak stays near a few of the largest tensors whatever N is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

CHILD = """
import json, sys
from pathlib import Path
import shardavg

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

inputs, out = [Path(p) for p in json.loads(sys.argv[1])], sys.argv[2]
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")  # the peak starts again from what the process holds now
before = status("VmRSS")
shardavg.merge(inputs, out)
print(json.dumps({"added": status("VmHWM") - before}))
"""


def model_shapes(megabytes: int, dim: int = 1024, vocab: int = 8192) -> dict[str, tuple[int, ...]]:
    """A transformer's tensors (an embedding, then blocks of attention and MLP weights) of about ``megabytes`` MB."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, dim)}
    block = {"attn.qkv.weight": (3 * dim, dim), "attn.out.weight": (dim, dim), "mlp.up.weight": (4 * dim, dim),
             "mlp.down.weight": (dim, 4 * dim), "norm.weight": (dim,)}  # fmt: skip
    layer = 0
    while sum(4 * torch.Size(s).numel() for s in shapes.values()) < megabytes * 1e6:
        shapes |= {f"blocks.{layer}.{name}": shape for name, shape in block.items()}
        layer += 1
    return shapes


def write_inputs(root: Path, shapes: dict[str, tuple[int, ...]], count: int) -> list[Path]:
    """``count`` checkpoints of the model, each with its own random weights."""
    folders = []
    for index in tqdm(range(count), desc="writing checkpoints", file=sys.stderr):
        folder = root / f"checkpoint-{index + 1}"
        folder.mkdir(parents=True)
        generator = torch.Generator().manual_seed(index)
        save_file({name: torch.randn(shape, generator=generator) for name, shape in shapes.items()},
                  str(folder / "model.safetensors"))  # fmt: skip
        folders.append(folder)
    return folders


# glibc returns a freed large block to the kernel only while its mmap threshold stays fixed (it
# raises the threshold after such a free, then keeps later blocks in its heap): fixed, the peak is
# what the merge holds at once, not where the allocator's caching happened to stand.
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def peak_added(inputs: list[Path], out: Path) -> int:
    """Bytes of resident memory one merge of ``inputs`` into ``out`` added, in a fresh process (Linux)."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([str(p) for p in inputs]), str(out)],
        capture_output=True, text=True, check=True, env=os.environ | {"OMP_NUM_THREADS": "1", **ALLOCATOR},
    )  # fmt: skip
    return json.loads(result.stdout.splitlines()[-1])["added"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mb", type=int, default=200)
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--dir", help="where to write the checkpoints (default: a temporary folder, removed after)")
    args = parser.parse_args()
    shapes = model_shapes(args.model_mb)
    model_bytes = sum(4 * torch.Size(s).numel() for s in shapes.values())
    largest = max(4 * torch.Size(s).numel() for s in shapes.values())
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="merge-memory-"))
    try:
        inputs = write_inputs(root / "inputs", shapes, max(args.counts))
        print(f"model: {model_bytes / 1e6:.0f} MB in {len(shapes)} fp32 tensors, the largest {largest / 1e6:.1f} MB")
        print("| inputs | peak memory added by the merge | in largest tensors |")
        print("|---:|---:|---:|")
        for count in args.counts:
            added = peak_added(inputs[:count], root / f"out-{count}")
            print(f"| {count} | {added / 1e6:.0f} MB | {added / largest:.1f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
