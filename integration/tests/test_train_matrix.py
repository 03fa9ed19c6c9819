"""Every layout from every weight source a user brings equals one process started from that
source (source_matrix.py: the table; source_checks.py: the checks), one gloo launch per world
size; and the pairs the trainer refuses are refused before any worker starts, with their
reason."""

from __future__ import annotations

import pytest
import torch
from dist_checks import layout_recipe
from layout_launch import write_fp8_base
from source_checks import (
    check_dcp_reads_only_its_chunks,
    check_from_source,
    matrix_folders,
    matrix_references,
)
from source_matrix import MATRIX_LAYOUTS, MATRIX_SOURCES, REFUSED, ROWS, cells

from dist_testkit import named_check, run_checks
from qwen35_trainer import train


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """The source matrix's folders and the one-process run from each."""
    root = tmp_path_factory.mktemp("matrix")
    folders = matrix_folders(root, write_fp8_base(tmp_path_factory.mktemp("fp8_base")))
    return folders, matrix_references(folders, root)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def launch(request, matrix, tmp_path_factory):
    world = request.param
    folders, references = matrix
    checks = {
        f"{layout}/{source}": named_check(
            f"{layout}/{source}@{world}",
            check_from_source,
            layout,
            source,
            folders,
            references[source, MATRIX_LAYOUTS[layout][1]],
            str(tmp_path_factory.mktemp(f"{layout}_{source}")),
        )
        for layout, source in cells(world)
    }
    checks["dcp_chunks"] = named_check(
        f"dcp_chunks@{world}", check_dcp_reads_only_its_chunks, str(tmp_path_factory.mktemp("dcp"))
    )
    return checks, run_checks(list(checks.values()), world, timeout=900)


@pytest.mark.parametrize("source", list(MATRIX_SOURCES))
@pytest.mark.parametrize("layout", list(MATRIX_LAYOUTS))
def test_layout_from_each_source_equals_one_process(launch, matrix, layout, source):
    """Each layout started from each folder a user brings equals one process from that
    folder; a refused pair is refused before any rank starts, with its reason."""
    checks, report = launch
    if (layout, source) in REFUSED:
        _assert_refused(layout, source, matrix[0])
        return
    if f"{layout}/{source}" not in checks:
        pytest.skip(f"{layout} runs at world {MATRIX_LAYOUTS[layout][2]}")
    report.assert_passed(checks[f"{layout}/{source}"])


def test_a_dcp_folder_trains_as_its_safetensors_twin(matrix):
    """The ``dcp`` folder (a transformers model's state dict through
    ``torch.distributed.checkpoint.save``) trains in one process exactly as the ``hf`` folder
    of the same model does."""
    for micro in (1, 2):
        (dcp_logs, dcp_state), (hf_logs, hf_state) = (matrix[1][s, micro] for s in ("dcp", "hf"))
        assert [log.loss for log in dcp_logs] == [log.loss for log in hf_logs]
        for name, value in hf_state.items():
            assert torch.equal(dcp_state[name], value), name


def test_a_rank_reads_only_the_dcp_chunks_of_its_rows(launch):
    """source_checks.check_dcp_reads_only_its_chunks on each launch's ranks."""
    checks, report = launch
    report.assert_passed(checks["dcp_chunks"])


def test_the_export_folder_trains_as_the_seeded_model(matrix):
    """The matrix's ``export`` folder holds the seeded weights (fp32, stacked experts, sharded
    with an index): one process started from it takes the seeded run's steps exactly."""
    logs, state = matrix[1]["export", 1]
    with train(layout_recipe(1, *ROWS, "model.mtp_layers=1")) as seeded:
        seeded_state = seeded.state_dict()
    for ours, theirs in zip(logs, seeded.logs, strict=True):
        assert (ours.loss, ours.grad_norm, ours.mtp_loss) == (
            theirs.loss,
            theirs.grad_norm,
            theirs.mtp_loss,
        )
    for name, value in seeded_state.items():
        assert torch.equal(state[name], value.float()), name


def _assert_refused(layout: str, source: str, folders: dict) -> None:
    """The layout checks every launch makes before any worker starts refuse the pair with
    its reason (source_matrix.REFUSED)."""
    from source_checks import source_overrides

    from qwen35_trainer.model import build_config
    from qwen35_trainer.parallel.layout_checks import validate_layout

    overrides, micro, (world, *_) = MATRIX_LAYOUTS[layout]
    recipe = layout_recipe(world, *source_overrides(source, folders, micro), *overrides)
    with pytest.raises(ValueError, match="invalid parallel layout") as err:
        validate_layout(recipe, world, config=build_config(recipe.model), on_this_machine=False)
    assert REFUSED[layout, source] in str(err.value)
