"""The dtypes raypd serves, by name.

Configs and cache layouts carry a dtype as its name, not a `torch.dtype`: the engine and API
processes read both and never load torch (docs/design.md §14); the worker turns names into
torch dtypes where it builds tensors.
"""

from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(dtype: object) -> str:
    """The name of a torch dtype (`torch.bfloat16` -> "bfloat16"), as configs and layouts carry it."""
    return str(dtype).removeprefix("torch.")
