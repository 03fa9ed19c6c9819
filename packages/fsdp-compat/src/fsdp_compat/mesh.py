"""Mesh dims by name, including dims made by ``DeviceMesh._flatten``.

The bug this module exists for: ``mesh["dp", "cp"]._flatten("dp_cp")`` registers the new 1-D
mesh in the ROOT mesh's ``_flatten_mapping``; ``"dp_cp"`` never appears in
``mesh.mesh_dim_names``. Code that checks ``name in mesh.mesh_dim_names`` (and falls back to
"dp" alone when it is missing) silently shards over DP only, so CP ranks hold full replicas and
their gradients are never reduced together.

Correctness argument: :func:`flatten_mesh` returns the flattened mesh OBJECT (whose process
group spans exactly the product of the named dims, rank order as in the root layout), and
callers keep using that object; :func:`get_mesh_dim` resolves a name first among the mesh's own
dims, then among the flattened meshes recorded on the root mesh, and raises when neither has it,
so a missing dim can never degrade into a smaller group.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["flatten_mesh", "get_mesh_dim", "mesh_dim_names_with_flattened"]


def _check_mesh(mesh: object) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expected a torch DeviceMesh, got {type(mesh).__name__}")
    if not mesh.mesh_dim_names:
        raise ValueError(f"the mesh needs named dims (mesh_dim_names), got {mesh}")
    return mesh


def _flattened(mesh: DeviceMesh) -> dict[str, DeviceMesh]:
    return dict(mesh._get_root_mesh()._flatten_mapping)


def mesh_dim_names_with_flattened(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh's own dim names followed by every flattened dim recorded on its root mesh."""
    mesh = _check_mesh(mesh)
    own = tuple(mesh.mesh_dim_names)
    return own + tuple(n for n in _flattened(mesh) if n not in own)


def get_mesh_dim(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D mesh called ``name``: one of ``mesh``'s dims or a dim flattened from its root.

    Raises ``ValueError`` listing the known names when ``name`` is neither.
    """
    mesh = _check_mesh(mesh)
    if not isinstance(name, str):
        raise TypeError(f"mesh dim name must be a str, got {type(name).__name__}")
    if name in mesh.mesh_dim_names:
        return mesh if mesh.ndim == 1 else mesh[name]
    flat = _flattened(mesh)
    if name in flat:
        return flat[name]
    raise ValueError(
        f"mesh has no dim {name!r}: its dims are {tuple(mesh.mesh_dim_names)}, "
        f"flattened dims on its root are {tuple(flat)}"
    )


def flatten_mesh(mesh: DeviceMesh, dims: Sequence[str], name: str | None = None) -> DeviceMesh:
    """One 1-D mesh spanning the product of ``dims`` (default name: the dims joined by "_").

    ``dims`` are dims of ``mesh``'s root (not flattened ones). One dim returns that dim's mesh;
    flattening the same dims under the same name twice returns the mesh made the first time.
    """
    mesh = _check_mesh(mesh)
    if isinstance(dims, str):
        dims = (dims,)
    dims = tuple(dims)
    if not dims:
        raise ValueError("flatten_mesh needs at least one dim name, got ()")
    if len(set(dims)) != len(dims):
        raise ValueError(f"dims must be distinct, got {dims}")
    root = mesh._get_root_mesh()
    root_names = tuple(root.mesh_dim_names or ())
    unknown = [d for d in dims if d not in root_names]
    if unknown:
        raise ValueError(
            f"cannot flatten {dims}: {unknown} are not dims of the root mesh {root_names} "
            f"(flattened dims {tuple(_flattened(mesh))} cannot be flattened again)"
        )
    if len(dims) == 1:
        return get_mesh_dim(root, dims[0])
    name = name or "_".join(dims)
    if name in root_names:
        raise ValueError(f"flattened name {name!r} clashes with a root mesh dim {root_names}")
    # torch itself raises ValueError when ``name`` was already flattened over other ranks.
    return root[dims]._flatten(name)
