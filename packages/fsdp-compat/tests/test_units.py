"""Unit-module resolution (no process group needed)."""

from __future__ import annotations

import pytest
from _models import Block, MoEModel, TinyTransformer
from torch import nn

from fsdp_compat.units import ep_modules, resolve_unit_modules


class Outer(nn.Module):
    """A unit class nested inside another unit class."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()
        self.lin = nn.Linear(2, 2)


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.outer = Outer()


def test_default_from_no_split_modules():
    model = TinyTransformer(layers=3)
    units, classes = resolve_unit_modules(model, None)
    assert classes == [Block]
    assert [id(u) for u in units] == [id(b) for b in reversed(model.blocks)]


@pytest.mark.parametrize("spec", [[Block], ["Block"], ["_models.Block"], Block, "Block"])
def test_classes_names_and_paths(spec):
    model = TinyTransformer()
    units, classes = resolve_unit_modules(model, spec)
    assert classes == [Block] and len(units) == 2


def test_children_before_parents():
    model = Nested()
    units, classes = resolve_unit_modules(model, [Outer, Block])
    assert units == [model.outer.inner, model.outer]
    assert set(classes) == {Outer, Block}


def test_root_is_never_a_unit():
    model = TinyTransformer()
    with pytest.raises(ValueError, match=r"\['TinyTransformer'\] match no submodule"):
        resolve_unit_modules(model, ["TinyTransformer"])


def test_errors():
    model = TinyTransformer()
    with pytest.raises(ValueError, match=r"\['Blok'\] match no submodule .* classes are \["):
        resolve_unit_modules(model, [Block, "Blok"])
    with pytest.raises(ValueError, match="has no _no_split_modules"):
        resolve_unit_modules(nn.Sequential(Block()), None)
    with pytest.raises(TypeError, match=r"nn\.Module classes or names"):
        resolve_unit_modules(model, [3])
    with pytest.raises(TypeError, match="classes or class names"):
        resolve_unit_modules(model, 3)
    model._no_split_modules = ["Absent"]
    with pytest.raises(
        ValueError, match=r"TinyTransformer\._no_split_modules entries \['Absent'\]"
    ):
        resolve_unit_modules(model, None)


def test_default_tolerates_absent_optional_classes():
    model = TinyTransformer()
    model._no_split_modules = ["Block", "VisionBlock"]
    units, classes = resolve_unit_modules(model, None)
    assert classes == [Block] and len(units) == 2


def test_plain_tensors_are_not_ep():
    assert ep_modules(MoEModel(), "ep") == []
