"""One mixed-precision description, translated to FSDP2 and to megatron-fsdp.

The two backends split the same idea differently:

- FSDP2 keeps fp32 sharded parameters and casts them at all-gather time: ``param_dtype`` is the
  compute dtype, ``reduce_dtype`` the gradient reduce-scatter dtype, ``output_dtype`` the dtype
  the module's outputs are cast to, ``cast_forward_inputs`` whether floating inputs are cast to
  ``param_dtype``.
- megatron-fsdp computes in the dtype the MODEL already has and keeps separate "main" buffers:
  ``main_params_dtype`` (optimizer weights), ``main_grads_dtype`` (accumulated gradients) and
  ``grad_comm_dtype`` (the reduce dtype).

The mapping is exact where both sides have the concept (``reduce_dtype`` ↔ ``grad_comm_dtype``)
and refuses, with the reason, where one backend cannot express a field (megatron-fsdp has no
output cast; its compute dtype is the model's dtype, so a different ``param_dtype`` is an error
instead of being ignored).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["MixedPrecision"]


def _check_dtype(name: str, value: object) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(
            f"MixedPrecision.{name} must be a floating torch.dtype or None, got {value!r}"
        )


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Backend-neutral mixed precision. ``None`` means "the backend's default / no cast".

    ``keep_dtype``: parameters for which it returns true are gathered and computed in their own
    dtype, not ``param_dtype`` (FSDP2's per-parameter ``param_dtype_override_fn``, torch >=
    2.15): e.g. frozen weights already stored in the compute dtype, or held in FP8, which a
    cast would turn into bf16 bytes. It must answer alike on every rank."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    keep_dtype: Callable[[nn.Parameter], bool] | None = None

    def __post_init__(self) -> None:
        for field in (
            "param_dtype",
            "reduce_dtype",
            "output_dtype",
            "main_params_dtype",
            "main_grads_dtype",
        ):
            _check_dtype(field, getattr(self, field))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecision.cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}"
            )
        if self.keep_dtype is not None and not callable(self.keep_dtype):
            raise TypeError(
                f"MixedPrecision.keep_dtype must be a callable or None, got {self.keep_dtype!r}"
            )

    def to_fsdp2(self) -> torch.distributed.fsdp.MixedPrecisionPolicy:
        """FSDP2's ``MixedPrecisionPolicy`` (the main-buffer fields have no FSDP2 meaning:
        FSDP2's sharded parameters stay in the model's dtype)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        extra = {}
        if self.keep_dtype is not None:
            if "param_dtype_override_fn" not in inspect.signature(MixedPrecisionPolicy).parameters:
                raise ValueError(
                    "MixedPrecision.keep_dtype needs FSDP2's param_dtype_override_fn (torch >= "
                    f"2.15); torch {torch.__version__} has none"
                )
            keep = self.keep_dtype
            extra["param_dtype_override_fn"] = lambda p: p.dtype if keep(p) else None
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            output_dtype=self.output_dtype,
            cast_forward_inputs=self.cast_forward_inputs,
            **extra,
        )

    def megatron_fields(self, model_dtypes: set[torch.dtype]) -> dict[str, torch.dtype | None]:
        """Field values for megatron-fsdp's ``MixedPrecisionPolicy``.

        ``model_dtypes``: the floating dtypes of the model's parameters (megatron computes in
        them). Raises ``ValueError`` for a setting megatron-fsdp cannot express.
        """
        if self.output_dtype is not None:
            raise ValueError(
                f"megatron-fsdp has no output cast; got output_dtype={self.output_dtype} "
                "(cast the loss inputs yourself or use backend='fsdp2')"
            )
        if self.keep_dtype is not None:
            raise ValueError(
                "megatron-fsdp computes every parameter in the model's one dtype: keep_dtype "
                "(parameters gathered in their own dtype) is an FSDP2 option"
            )
        if self.param_dtype is not None and model_dtypes != {self.param_dtype}:
            raise ValueError(
                f"megatron-fsdp computes in the model's own dtype; param_dtype={self.param_dtype} "
                f"but the model's parameters are {sorted(map(str, model_dtypes))}: cast the model "
                "to param_dtype before sharding"
            )
        return {
            "main_params_dtype": self.main_params_dtype,
            "main_grads_dtype": self.main_grads_dtype,
            "grad_comm_dtype": self.reduce_dtype,
        }
