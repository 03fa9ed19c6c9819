"""Sequence packing, block-diagonal varlen attention and the gated delta rule under context parallelism."""

from cp_varlen_attn.attention import BACKENDS, varlen_attention
from cp_varlen_attn.exchange import ExchangePlan, exchange_rows, plan_exchange
from cp_varlen_attn.hf_flash_mask import preserve_indexed_mask_for_flash_attention, unpad_data_from_indexed_mask
from cp_varlen_attn.layout import CPLayout, Piece, shard_sequence, unshard_sequence
from cp_varlen_attn.packing import (
    PackedBatch,
    cu_seqlens_from_doc_ids,
    doc_ids_from_cu_seqlens,
    doc_ids_from_indexed_mask,
    indexed_mask_from_doc_ids,
    pack_documents,
)
from cp_varlen_attn.strategies import STRATEGIES, plan_cp_layout

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "STRATEGIES",
    "ExchangePlan",
    "CPLayout",
    "PackedBatch",
    "Piece",
    "__version__",
    "cu_seqlens_from_doc_ids",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_indexed_mask",
    "exchange_rows",
    "indexed_mask_from_doc_ids",
    "pack_documents",
    "plan_cp_layout",
    "plan_exchange",
    "preserve_indexed_mask_for_flash_attention",
    "shard_sequence",
    "unpad_data_from_indexed_mask",
    "unshard_sequence",
    "varlen_attention",
]
