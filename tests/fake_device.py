"""A stand-in accelerator for checking the GPU code paths' plumbing on a CPU-only machine.

Inside `fake_accelerator()` tensors moved to the returned device (`meta`) are fake tensors
(torch's FakeTensorMode): shapes, dtypes and devices propagate through every op, and the GPU
kernels' shape contracts (their meta functions) run, but no number is computed. luced treats
any device that is not the CPU as a GPU (`weight_only`, `decode_graph`), so the code under
test takes its GPU branches. Two faults of GPU code surface here as exceptions:

    a CPU tensor mixed into the device computation   FakeTensorDeviceMismatchError
    a host sync (`.item()`, `nonzero`, `bool(t)`)    DataDependentOutputException (and kin)

The second is what a captured CUDA graph cannot contain. Values are never checked here:
that needs the GPU (the tests marked `cuda`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


@contextlib.contextmanager
def fake_accelerator() -> Iterator[torch.device]:
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield torch.device("meta")
