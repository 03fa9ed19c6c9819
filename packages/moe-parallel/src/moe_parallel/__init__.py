"""MoE layer with dropless expert parallelism, TP-safe plans, EP+TP gradient correctness, activation checkpointing and frozen experts in block-scaled FP8."""

from moe_parallel.checkpointing import apply_activation_checkpointing, sdpa_preserving_context
from moe_parallel.dispatch import all_to_all_expert_compute
from moe_parallel.expert_parallel import apply_expert_parallel
from moe_parallel.fp8 import BlockFormat, FP8Weight, dequantize, quantize
from moe_parallel.fp8_experts import quantize_experts
from moe_parallel.fp8_matmul import fp8_linear
from moe_parallel.grouped import LoRAFactors, expert_swiglu
from moe_parallel.lora import LoRASpec, add_expert_lora
from moe_parallel.moe import (
    MoE,
    MoEStats,
    balancing_loss_of,
    load_balancing_loss,
    router_statistics,
)
from moe_parallel.tensor_parallel import apply_tensor_parallel, validate_tp_plan
from moe_parallel.transformers import swap_moe_blocks

__version__ = "0.2.0"

__all__ = [
    "BlockFormat",
    "FP8Weight",
    "LoRAFactors",
    "LoRASpec",
    "MoE",
    "MoEStats",
    "__version__",
    "add_expert_lora",
    "all_to_all_expert_compute",
    "apply_activation_checkpointing",
    "apply_expert_parallel",
    "apply_tensor_parallel",
    "balancing_loss_of",
    "dequantize",
    "expert_swiglu",
    "fp8_linear",
    "load_balancing_loss",
    "quantize",
    "quantize_experts",
    "router_statistics",
    "sdpa_preserving_context",
    "swap_moe_blocks",
    "validate_tp_plan",
]
