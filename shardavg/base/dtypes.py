"""The dtypes shardavg stores, and how they are spelled: ``float32`` in descriptions and on the
command line, ``F32`` in safetensors headers."""

from __future__ import annotations

import torch

DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: how descriptions and the CLI spell a dtype."""
    return str(dtype).removeprefix("torch.")


DTYPES = {dtype_name(dtype): dtype for dtype in DTYPE_CODES}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
