"""Mixed precision: the one place that decides the autocast dtype, the GradScaler and FSDP's policy.

``amp`` is ``False``, ``True``, ``"bf16"`` or ``"fp16"``. ``True`` means
bf16 where the device computes it natively (the CPU, a CUDA GPU that
reports bf16 support) and fp16 elsewhere. fp16 needs a ``GradScaler``
(its range is small: gradients underflow without loss scaling); bf16 has
fp32's range and needs none. The step, evaluation, prediction and FSDP's
``MixedPrecisionPolicy`` all ask the same :class:`Precision`, as Lightning
Fabric's precision plugins are asked by both its step and its strategies.

Private: :class:`~nn_handler.NNHandler` is the public face.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import invalid
from .._tree import apply
from ..errors import ConfigurationError

AMP_CHOICES = (False, True, "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FULL_PRECISION = contextlib.nullcontext()  # one no-op for every step: a nullcontext is entered any number of times


def check_amp(amp: Any) -> bool | str:
    """``amp`` as given, when it is one of :data:`AMP_CHOICES`.

    Example:
        >>> check_amp("bf16")
        'bf16'
        >>> check_amp("fp8")
        Traceback (most recent call last):
        ...
        nn_handler.errors.ConfigurationError: amp must be False, True, 'bf16' or 'fp16', got 'fp8'
    """
    if isinstance(amp, bool) or (isinstance(amp, str) and amp in _DTYPES):
        return amp
    raise invalid("amp", "False, True, 'bf16' or 'fp16'", amp)


def bf16_supported(device: torch.device) -> bool:
    """True where bf16 runs natively: the CPU, or a CUDA GPU that reports it (not emulated)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    return False


@dataclass(frozen=True)
class Precision:
    """The autocast dtype of a run on ``device_type`` (None: full precision) and what follows from it.

    Example:
        >>> p = Precision.resolve(True, torch.device("cpu"))
        >>> p.dtype, p.needs_scaler, p.name
        (torch.bfloat16, False, 'bf16')
        >>> Precision.resolve("fp16", torch.device("cpu")).needs_scaler
        True
        >>> Precision.resolve(False, torch.device("cpu")).name
        'off'
    """

    device_type: str
    dtype: torch.dtype | None = None

    @classmethod
    def resolve(cls, amp: bool | str, device: torch.device) -> "Precision":
        """What ``amp`` means on ``device``.

        Raises:
            ConfigurationError: ``amp`` is not a known value, or asks for bf16 where the device lacks it.
        """
        amp = check_amp(amp)
        if amp is False:
            return cls(device.type)
        if amp is True:
            return cls(device.type, torch.bfloat16 if bf16_supported(device) else torch.float16)
        if amp == "bf16" and not bf16_supported(device):
            raise ConfigurationError(
                f"amp='bf16': {device} does not compute in bf16 natively (a CUDA GPU needs compute capability "
                f">= 8.0); use amp='fp16' (with loss scaling) or amp=True, which picks what the device supports")
        return cls(device.type, _DTYPES[amp])

    @property
    def name(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"off"``."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "off"}[self.dtype]

    @property
    def needs_scaler(self) -> bool:
        """fp16 gradients need loss scaling; bf16 and fp32 ones do not."""
        return self.dtype == torch.float16

    def autocast(self):
        """``torch.autocast`` to :attr:`dtype`, or a no-op context in full precision."""
        if self.dtype is None:
            return _FULL_PRECISION
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def convert_output(self, outputs: Any) -> Any:
        """``outputs`` with the half-precision floats autocast left in them back in fp32 (a no-op without amp).

        What evaluation and prediction return, as Lightning Fabric's precision
        plugins convert a forward's outputs: the dtype the exported model's
        outputs have, whatever amp the handler trained with.

        Example:
            >>> p = Precision("cpu", torch.bfloat16)
            >>> out = p.convert_output({"logits": torch.ones(1, dtype=torch.bfloat16),
            ...                         "ids": torch.ones(1, dtype=torch.long)})
            >>> out["logits"].dtype, out["ids"].dtype
            (torch.float32, torch.int64)
        """
        if self.dtype is None:
            return outputs
        return apply(outputs, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """A ``GradScaler`` for fp16, else None.

        The plain scaler serves FSDP2 too: its gradients are DTensors, and
        DTensor reduces the scaler's found-inf flag over the shards, so every
        rank skips the same steps.
        """
        return torch.amp.GradScaler(self.device_type) if self.needs_scaler else None

    def fsdp_policy(self):
        """FSDP2's ``MixedPrecisionPolicy``: parameters in :attr:`dtype` for forward/backward, fp32 reduction."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)


def update_scale(scaler: torch.amp.GradScaler, waiting: list[torch.Tensor]) -> None:
    """``scaler.update()`` right after an optimizer's ``scaler.step``, the gradients ``waiting`` kept at the scale.

    ``waiting`` are gradients that other optimizers have not stepped on yet
    (an accumulation group's earlier micro-batches, a loss that reached them
    too): made at the old scale, they are brought to the new one, so that
    their optimizer unscales each by the scale it was multiplied by. The
    scale changes by powers of two (``growth_factor``, ``backoff_factor``), so
    this is exact.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        >>> w = torch.zeros(1, requires_grad=True)
        >>> opt = torch.optim.SGD([w], lr=1.0)
        >>> scaler.scale(w.sum() * float("inf")).backward()
        >>> scaler.step(opt)                       # skipped: an inf gradient
        >>> waiting = [torch.tensor([8.0])]        # 1.0, made at the scale of 8
        >>> update_scale(scaler, waiting)
        >>> scaler.get_scale(), waiting[0]         # backed off, and the waiting gradient with it
        (4.0, tensor([4.]))
    """
    if not waiting:
        scaler.update()
        return
    before = scaler.get_scale()  # reads the device only where a gradient waits (accumulation under fp16)
    scaler.update()
    after = scaler.get_scale()
    if after != before:
        torch._foreach_mul_(waiting, after / before)
