"""``masked_update_many_``'s kernel compiled for an H100 (sm_90) on a machine without a GPU, with
the ``ptxas`` Triton ships: it compiles, and a program inside its piece moves in 16-byte vectors
where the plan found every address 16-byte aligned. (Its bits on a GPU: tests_gpu/test_kernels_cuda.py.)"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardavg.update import kernels

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """The kernels' module as the GPU builds it (not the interpreter), compiling into ``tmp_path``."""
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is not installed: it is a test dependency (pip install -e '.[test]'), see pyproject.toml")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernels.reset()
    yield kernels._module()
    kernels.reset()


def global_accesses(module: Any, live: Any, shadows: list[Any], align: int, copy: int = 0) -> set[str]:
    """The PTX global loads and stores of ``masked_lerp_many`` for these dtypes (``tl`` dtypes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict.fromkeys(["live_table", "piece_of_program", "index_in_piece", "numels"], "*i64") | {"ok": "*i1"}
    constants: dict[str, Any] = {
        "LIVE": live,
        "ALIGN": align,
        "COUNT": len(shadows),
        "COPY": copy,
        "PROGRAM_NUMEL": 1024,
    }
    for slot in range(kernels.MAX_SHADOWS):
        constants[f"S{slot}"] = shadows[slot] if slot < len(shadows) else None
        signature[f"t{slot}"] = "*i64" if slot < len(shadows) else "constexpr"
        signature[f"w{slot}"] = "*fp32" if slot < len(shadows) and not copy >> slot & 1 else "constexpr"
    constants |= {name: None for name, kind in signature.items() if kind == "constexpr"}
    signature |= dict.fromkeys(["LIVE", "S0", "S1", "S2", "S3", "ALIGN", "COUNT", "COPY", "PROGRAM_NUMEL"], "constexpr")
    source = ASTSource(fn=module.masked_lerp_many, signature=signature, constexprs=constants)
    try:
        built = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    except RuntimeError as error:  # (a Triton without its NVIDIA backend's ptxas)
        pytest.skip(f"Triton cannot compile for sm_90 here: {error}")
    assert "fma.rn.f32" in built.asm["ptx"]  # (the lerp's fmas, explicit: rounded once)
    return set(re.findall(r"(?:ld|st)\.global[.\w]*", built.asm["ptx"]))


def test_aligned_pieces_move_in_16_byte_vectors_and_unaligned_ones_still_compile(compiled) -> None:
    import triton.language as tl

    fp32 = global_accesses(compiled, tl.float32, [tl.float32], 16)
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= fp32, fp32
    mixed = global_accesses(compiled, tl.bfloat16, [tl.float32, tl.bfloat16], 16, copy=0b10)
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= mixed, mixed  # (8 bf16 or 4 fp32 a vector)
    unaligned = global_accesses(compiled, tl.float32, [tl.float32], 4)
    assert not any(".v" in access for access in unaligned), unaligned
