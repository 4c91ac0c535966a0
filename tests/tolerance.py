"""Comparing numbers that two different code paths computed.

Two code paths that compute the same function in floating point (an engine started from a directory vs one updated
from it, batched vs single rows, the engine vs the trainer) agree to rounding, not bit for bit: which SIMD kernel
runs, how a reduction is split, even the alignment of a tensor in memory differ from one CPU to the next. Such
comparisons use :func:`assert_close_for_dtype`, a tolerance derived from the dtype the numbers were computed in;
exact equality (``torch.equal``, ``==``) is for results of literally the same code path (a weight copied, the same
request run twice, a value passed through).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def assert_close_for_dtype(actual: torch.Tensor | Sequence[float], expected: torch.Tensor | Sequence[float],
                           dtype: torch.dtype | str, *, msg: str | None = None) -> None:
    """``actual`` ≈ ``expected`` (any equal shapes) to within the rounding of ``dtype`` (torch.testing's tolerances
    for that dtype: float32 rtol 1.3e-6, atol 1e-5; bfloat16 rtol 1.6e-2, atol 1e-5).

    Python floats (e.g. ``output_logprobs``) are compared as ``dtype`` tensors, not as float64, so a value computed
    in float32 is held to float32's rounding. ``dtype`` is a ``torch.dtype`` or its name (``"float32"``).
    """
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype or its name (e.g. 'float32'), got {dtype!r}")
    a = torch.as_tensor(actual).to(dt)
    e = torch.as_tensor(expected).to(dt)
    torch.testing.assert_close(a, e, msg=msg)
