"""What CUDA graph capture forbids, checked on a CPU: a step runs on meta tensors (which
hold no values, so any read of one on the host fails) under a guard that names the first
forbidden operation:

- host-to-device copies: a tensor built from host data (torch.tensor), a CPU tensor mixed
  into a device computation, and a Python scalar written through an index tensor
  (`x[index] = 0.0`: on CUDA, PyTorch makes the scalar a CPU tensor and copies it over);
- device-to-host reads: .item(), .tolist(), bool(), int(), float(), .cpu(), .numpy();
- shapes that depend on the data: nonzero, masked_select, unique, boolean-mask indexing.

These are what make capture fail on a GPU ("Cannot copy between CPU and CUDA tensors
during CUDA graph capture", "operation not permitted when stream is capturing"), or
make a replayed graph wrong."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class CaptureViolation(AssertionError):
    pass


READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
FROM_HOST = {"tensor", "as_tensor", "from_numpy"}
DATA_SHAPED = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere", "nonzero_static"}
DATA_SHAPED_OPS = {"nonzero", "masked_select", "unique_dim", "_unique", "_unique2", "unique_consecutive", "_local_scalar_dense"}


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _tensors(values) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _has_tensor_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) for p in parts)


class _Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in READS:
            raise CaptureViolation(f"reads a device value on the host ({name})")
        if name in FROM_HOST:
            raise CaptureViolation(f"builds a tensor from host data (torch.{name}): a host-to-device copy")
        if name in DATA_SHAPED:
            raise CaptureViolation(f"shapes a tensor by its data ({name})")
        if name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values())):
            raise CaptureViolation("copies a device tensor to the host (.to('cpu'))")
        if name == "__setitem__" and len(args) == 3 and _has_tensor_index(args[1]) and not isinstance(args[2], torch.Tensor):
            raise CaptureViolation(
                "writes a Python scalar through an index tensor (x[index] = value): on CUDA the scalar becomes a "
                "CPU tensor copied to the device; use index_fill_ / masked_fill_")
        if name == "__getitem__" and len(args) == 2:
            parts = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                raise CaptureViolation("indexes with a boolean mask: a shape that depends on the data")
        return func(*args, **kwargs)


class _Operators(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in DATA_SHAPED_OPS:
            raise CaptureViolation(f"{name}: reads a value on the host or shapes a tensor by its data")
        host = [t for t in _tensors(list(args) + list(kwargs.values())) if t.device.type == "cpu"]
        if host:
            raise CaptureViolation(f"{name} is given a CPU tensor of shape {tuple(host[0].shape)}: a host-to-device copy")
        return func(*args, **kwargs)


@contextmanager
def capture_guard() -> Iterator[None]:
    """Run a step on meta tensors inside this: it raises CaptureViolation at the first
    operation that CUDA graph capture forbids."""
    with _Functions(), _Operators():
        yield
