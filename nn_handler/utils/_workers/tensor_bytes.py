"""Small CPU tensors inside a message, as their raw bytes: one copy each way, and no ``torch.save``.

torch's own pickling of a tensor runs ``torch.save`` on its storage, which
costs tens of microseconds per tensor; its raw bytes cost a copy. A map moves
thousands of small tensors a second, so each side takes as few torch calls
per tensor as it can: :func:`reduce_tensor` reads a dense tensor's bytes
where they lie, :func:`rebuild_tensor` makes one ``frombuffer`` in the
tensor's own dtype. A list of tensors of one dtype (a map's chunk, its
results) goes further: :func:`pack_list` copies them all in one ``cat``, to
pickle as one block of bytes and their shapes.

Either way each tensor comes back as a tensor of its own: its own memory
(writable, nothing shared with the message or with the others), its dtype,
its shape, contiguous (strides are not kept, see ``docs/executor.md``).

Example:
    >>> import pickle
    >>> sent = [torch.arange(3), torch.arange(6).reshape(2, 3).t(), torch.tensor(7)]
    >>> back = pickle.loads(pickle.dumps(pack_list(sent, limit=1024)))
    >>> [t.tolist() for t in back]
    [[0, 1, 2], [[0, 3], [1, 4], [2, 5]], 7]
"""

from __future__ import annotations

import ctypes
import math

import torch

# Bytes out of a tensor without numpy (not a dependency: Tensor.numpy() fails
# without it). A torch storage has no buffer interface and bytes() of one
# goes element by element, so the raw memory is copied through the C API.
_bytes_at = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_at.restype = ctypes.py_object
_bytes_at.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def rebuild_tensor(data: bytes, dtype: torch.dtype, shape: tuple, requires_grad: bool) -> torch.Tensor:
    """The tensor :func:`reduce_tensor` sent: its own copy of ``data``, viewed as ``dtype`` and ``shape``."""
    if not data:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        # A bytearray of its own: writable (bytes are not), and freed with the tensor.
        tensor = torch.frombuffer(bytearray(data), dtype=dtype)
        if len(shape) != 1:
            tensor = tensor.view(shape)
    return tensor.requires_grad_() if requires_grad else tensor


def reduce_tensor(t: torch.Tensor):
    """``t`` (a CPU tensor, strided, with no conjugate or negative bit) as its bytes, for pickle."""
    dense = t if t.is_contiguous() else t.contiguous()
    nbytes = dense.nbytes
    data = _bytes_at(dense.data_ptr(), nbytes) if nbytes else b""  # data_ptr counts the storage offset
    return rebuild_tensor, (data, t.dtype, tuple(t.shape), t.requires_grad)


class PackedList:
    """A list of tensors as one block of bytes: pickled, it loads as the list (:func:`rebuild_list`)."""

    __slots__ = ("args",)

    def __init__(self, data: bytes, dtype: torch.dtype, shapes: list):
        self.args = (data, dtype, shapes)

    def __reduce__(self):
        return rebuild_list, self.args


def pack_list(items, limit: int) -> PackedList | None:
    """``items`` as one block of bytes and their shapes; ``None`` unless they all can travel so.

    They can when the list holds at least two distinct plain tensors of one
    dtype, on the CPU, none of them needing grad or nested, of fewer than
    ``limit`` bytes in all. Anything else is left to the caller's pickler (a
    tensor at a time, or a file for a large one).
    """
    if type(items) is not list or len(items) < 2 or type(items[0]) is not torch.Tensor:
        return None
    first = items[0]
    dtype = first.dtype
    if first.is_quantized or first.layout is not torch.strided or first.nbytes * len(items) >= limit:
        return None  # (quantized: a property of the dtype; the size: a guess, checked below)
    if len(set(map(id, items))) != len(items):
        return None  # one tensor twice: pickle's memo sends it once, and it must come back as one
    shapes = []
    try:  # (a nested tensor has no shape to give: RuntimeError)
        for t in items:  # the least asked of each tensor: cat checks the rest once for all (below)
            if type(t) is not torch.Tensor or t.dtype is not dtype or t.requires_grad:
                return None
            shapes.append(tuple(t.shape))
        # cat copies 1-D tensors as they are; flattening takes any shape, at a view per tensor. Either
        # resolves a conjugate or negative bit, and refuses a mix of devices, layouts or nested tensors.
        flat = torch.cat(items) if all(len(s) == 1 for s in shapes) else torch._utils._flatten_dense_tensors(items)
    except RuntimeError:
        return None
    if not flat.is_cpu or flat.layout is not torch.strided or flat.is_nested or flat.nbytes >= limit:
        return None
    data = _bytes_at(flat.data_ptr(), flat.nbytes) if flat.nbytes else b""
    return PackedList(data, dtype, shapes)


def rebuild_list(data: bytes, dtype: torch.dtype, shapes: list) -> list:
    """The tensors :func:`pack_list` sent, each with its own copy of its bytes."""
    view = memoryview(data)
    itemsize = dtype.itemsize
    frombuffer = torch.frombuffer
    out = []
    start = 0
    for shape in shapes:
        end = start + (shape[0] if len(shape) == 1 else math.prod(shape)) * itemsize
        if end == start:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        tensor = frombuffer(bytearray(view[start:end]), dtype=dtype)
        out.append(tensor if len(shape) == 1 else tensor.view(shape))
        start = end
    return out
