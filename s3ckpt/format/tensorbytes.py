"""Tensors as bytes and bytes as tensors, without NumPy and without needless copies. No I/O.

Tensors are stored as their elements' raw bytes in row-major order; that is what lets a reader
fetch a byte range of a tensor, and write it straight into a destination tensor's memory.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["as_flat_bytes", "memory_at", "memory_of"]

# A memoryview of raw memory in one C call: a ctypes array type per size (what this did before)
# cost 60-140 us per tensor, more than DCP's own work for a small one.
_view_of_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_view_of_memory.restype = ctypes.py_object
_view_of_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def as_flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of the tensor's own elements in row-major order, on its device.

    A view shares memory with its base but contributes only its own elements; a non-contiguous
    tensor (or one with a lazy conjugate/negative bit) is copied once to make it contiguous.
    """
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"s3ckpt stores dense strided tensors only, got layout {tensor.layout}")
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


def memory_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory.

    The view does not keep the tensor alive: the caller must hold a reference while using it.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("memory_of needs a contiguous CPU tensor")
    return memory_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def memory_at(address: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes of CPU memory at ``address``: `memory_of` for a
    caller that has checked the tensor already (a load, per tensor)."""
    if size == 0:
        return memoryview(bytearray())
    view: memoryview = _view_of_memory(address, size, _PYBUF_WRITE)
    return view
