"""Multi-rank parity: one gloo launch per world size runs every check in dist_checks.py."""

from __future__ import annotations

import pytest
from dist_checks import (
    check_ac_under_ep_wraps_vision,
    check_compiled_ep_parity,
    check_ep_detached_router_is_caught,
    check_ep_fp8_lora_parity,
    check_ep_lora_parity,
    check_ep_parity,
    check_ep_parity_te_stand_in,
    check_ep_size_must_divide_experts,
    check_ep_tp_grads,
    check_ep_tp_token_split_exact,
    check_global_aux_loss_share,
    check_tp_shared_expert,
    check_zero_token_optimizer_step,
    seq_len,
)

from dist_testkit import run_checks

CHECKS = [
    check_ep_parity,
    check_compiled_ep_parity,
    check_ep_parity_te_stand_in,
    check_ep_detached_router_is_caught,
    check_ep_size_must_divide_experts,
    check_global_aux_loss_share,
    check_tp_shared_expert,
    check_ep_tp_grads,
    check_ep_tp_token_split_exact,
    check_zero_token_optimizer_step,
    check_ac_under_ep_wraps_vision,
    check_ep_lora_parity,
    check_ep_fp8_lora_parity,
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def report(request):
    return run_checks(CHECKS, request.param, timeout=180)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_rank_check(report, check):
    report.assert_passed(check)


@pytest.mark.parametrize(
    "check", [check_ep_parity, check_compiled_ep_parity, check_ep_parity_te_stand_in]
)
def test_token_counts_are_uneven_and_complete(report, check):
    counts = report.assert_passed(check)
    totals = [sum(c) for c in counts]
    assert len(set(totals)) == len(totals), totals  # every rank routed a different number
    assert totals == [2 * seq_len(r) for r in range(report.world_size)]
    assert 0 in totals
