"""Sequence packing, block-diagonal varlen attention and the gated delta rule under context parallelism."""

from cp_varlen_attn.attention import BACKENDS, resolve_attention_backend, varlen_attention
from cp_varlen_attn.conv import causal_conv1d
from cp_varlen_attn.exchange import ExchangePlan, exchange_rows, plan_exchange
from cp_varlen_attn.gated_delta import GDN_BACKENDS, gated_delta_rule, resolve_gdn_backend
from cp_varlen_attn.gdn_cp import SummaryPlan, plan_summaries
from cp_varlen_attn.hf_flash_mask import (
    preserve_indexed_mask_for_flash_attention,
    unpad_data_from_indexed_mask,
)
from cp_varlen_attn.hf_gdn import packed_gated_deltanet_forward
from cp_varlen_attn.layout import (
    PAIR_BOUND,
    TOKEN_BOUND,
    CPLayout,
    Piece,
    shard_sequence,
    unshard_sequence,
)
from cp_varlen_attn.mrope import mrope_positions
from cp_varlen_attn.packing import (
    PackedBatch,
    cu_seqlens_from_doc_ids,
    doc_ids_from_cu_seqlens,
    doc_ids_from_indexed_mask,
    indexed_mask_from_doc_ids,
    pack_documents,
)
from cp_varlen_attn.strategies import STRATEGIES, plan_cp_layout
from cp_varlen_attn.validation import validate_layout

__version__ = "0.2.0"

__all__ = [
    "BACKENDS",
    "GDN_BACKENDS",
    "PAIR_BOUND",
    "STRATEGIES",
    "TOKEN_BOUND",
    "CPLayout",
    "ExchangePlan",
    "PackedBatch",
    "Piece",
    "SummaryPlan",
    "__version__",
    "causal_conv1d",
    "cu_seqlens_from_doc_ids",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_indexed_mask",
    "exchange_rows",
    "gated_delta_rule",
    "indexed_mask_from_doc_ids",
    "mrope_positions",
    "pack_documents",
    "packed_gated_deltanet_forward",
    "plan_cp_layout",
    "plan_exchange",
    "plan_summaries",
    "preserve_indexed_mask_for_flash_attention",
    "resolve_attention_backend",
    "resolve_gdn_backend",
    "shard_sequence",
    "unpad_data_from_indexed_mask",
    "unshard_sequence",
    "validate_layout",
    "varlen_attention",
]
