"""Hugging Face Hub ids as the recipe's inputs: ``model.path`` and ``data.processor`` name model
repositories, ``data.path`` and ``data.eval_path`` dataset repositories, each read at a revision
(:data:`HUB_KEYS`: ``model.revision``, ``data.processor_revision``, ``data.revision``,
``data.eval_revision``; a branch, tag or commit, ``main`` when unset).

Which is meant. A value names the Hub when it has the shape ``org/name`` (one ``/``, relative,
not ``./``, ``~`` or ``builtin:``, not ending in ``.jsonl`` / ``.json`` / ``.parquet``, which
name data files) and no local path of that name exists: a local folder or file
of the same name always wins (``recipe/files.py`` keeps such a value as written only when it is
not there relative to the recipe file; a recipe mapping's is relative to the working
directory). A value of that shape that huggingface_hub's own rules refuse is a recipe error
naming the key.

Resolution, once. :func:`with_hub_snapshots` runs when the recipe is built, before
``config.json`` is read (:mod:`.model_path`): each id becomes the folder of its snapshot in
huggingface_hub's cache (``snapshot_download``: ``HF_HOME`` / ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, ``HF_TOKEN`` and ``HF_ENDPOINT`` honoured), and ``from_hub`` records
``key: id@revision``. Every later reader — config, weights, processor, rows, export — reads a
local folder with the code it always had, so a Hub id and a local copy of the same files run
the same computation. A snapshot folder is named by its commit and holds that commit's files
only, so the folder (and the run header that prints it) says exactly what was read. Only the
files the trainer reads are fetched (:data:`MODEL_FILES`; ``weights=False``, the planner's
case, leaves out the safetensors); of a dataset repository with ``data.subset`` the files its
README's ``configs`` give that subset (and the README), else the whole repository. Each process
resolves for itself (a memo keeps one resolution per process); an unpinned branch that moves
between two ranks' resolutions would give them different commits, so the ranks compare
theirs (:func:`hub_commits`, :func:`check_same_commits`) before the model is built.

Without the Hub (no network, or ``HF_HUB_OFFLINE=1``) and no complete cached copy, one
``ValueError`` names the key, the id, the revision and the three fixes: the network, ``hf
download`` into the cache, or a local path. Streaming (``datasets``' ``streaming=True``) is not
used: the trainer deals rows by index (seeded shuffles, exact resume), which a stream cannot give.
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = [
    "HUB_KEYS",
    "MODEL_FILES",
    "PROCESSOR_FILES",
    "check_same_commits",
    "hub_commits",
    "with_hub_snapshots",
]

# The files of a processor folder the trainer reads (and an export copies byte for byte).
PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
# A model repository's files without its weights (a processor's, or the planner's).
LIGHT_FILES = ("config.json", "generation_config.json", *PROCESSOR_FILES)
# What the trainer reads of a model repository: config, weights, processor, generation config.
MODEL_FILES = (*LIGHT_FILES, *WEIGHT_PATTERNS)
# (section, key, its revision's key, repository type)
HUB_KEYS = (
    ("model", "path", "revision", "model"),
    ("data", "processor", "processor_revision", "model"),
    ("data", "path", "revision", "dataset"),
    ("data", "eval_path", "eval_revision", "dataset"),
)
# a key that may name the repository another key names first: (section, key, revision key)
_NAMED_FIRST = {
    ("data", "processor"): ("model", "path", "revision"),
    ("data", "eval_path"): ("data", "path", "revision"),
}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")  # what data.path reads as one file
_SNAPSHOT = re.compile(r"(?:models|datasets)--.+[/\\]snapshots[/\\]([0-9a-f]{40})$")
_MEMO: dict[tuple, str] = {}


def hub_shaped(value: Any) -> bool:
    """Whether ``value`` has a Hub id's shape (``org/name``; module docstring); a name ending
    in a data file's suffix (``data/train.jsonl``) is a local file, never an id."""
    return (
        isinstance(value, str)
        and value.count("/") == 1
        and not value.startswith(("/", ".", "~", "builtin:"))
        and "\\" not in value
        and not value.endswith(FILE_SUFFIXES)
    )


def _revision(data: dict[str, Any], section: str, key: str, revision_key: str) -> str:
    """The revision ``section.key`` is read at: its own key, else — for a repository the recipe
    names twice (``data.processor`` = ``model.path``, ``data.eval_path`` = ``data.path``) — the
    first one's, else ``main``."""
    values = data.get(section) or {}
    if values.get(revision_key) is not None:
        return values[revision_key]
    first = _NAMED_FIRST.get((section, key))
    if first is not None:
        owner = data.get(first[0]) or {}
        if owner.get(first[1]) == values.get(key) and owner.get(first[2]) is not None:
            return owner[first[2]]
    return "main"


def _subset(data: dict[str, Any], key: str) -> str | None:
    """The dataset subset ``data.key`` is read with (``DataRecipe.subset_of``'s rule)."""
    values = data.get("data") or {}
    if key == "path" or values.get("eval_subset") is not None:
        return values.get("subset" if key == "path" else "eval_subset")
    return values.get("subset") if values.get("eval_path") == values.get("path") else None


def with_hub_snapshots(data: dict[str, Any], *, weights: bool = True) -> dict[str, Any]:
    """The recipe mapping ``data`` with every Hub id of :data:`HUB_KEYS` replaced by its
    snapshot folder and recorded in its section's ``from_hub`` (module docstring); ``weights``:
    fetch a model's safetensors too."""
    out = dict(data)
    for section, key, revision_key, kind in HUB_KEYS:
        values = data.get(section)
        value = values.get(key) if isinstance(values, dict) else None
        if not hub_shaped(value) or os.path.exists(value):
            continue
        where = f"{section}.{key}"
        _check_id(where, value)
        revision = _revision(data, section, key, revision_key)
        asked = (where, f"{section}.{revision_key}")
        if kind == "model":
            files = MODEL_FILES if weights and key == "path" else LIGHT_FILES
            folder = _snapshot(asked, value, revision, kind, files)
        else:
            folder = _dataset_snapshot(asked, value, revision, _subset(data, key))
        current = dict(out[section])
        current[key] = folder
        current["from_hub"] = {**(current.get("from_hub") or {}), key: f"{value}@{revision}"}
        if section == "model":
            current.setdefault("base_as_written", value)  # what an adapter export names
        out[section] = current
    return out


def _check_id(where: str, value: str) -> None:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except ValueError as error:
        raise ValueError(
            f"{where}: {value!r} is no local path and not a Hub id (org/name): {error}"
        ) from None


def _dataset_snapshot(
    asked: tuple[str, str], repo_id: str, revision: str, subset: str | None
) -> str:
    """A dataset repository's snapshot: with ``subset``, its README first, then the files its
    ``configs`` give that subset (at the README's commit, so both are of one commit)."""
    if subset is None:
        return _snapshot(asked, repo_id, revision, "dataset", None)
    readme = _snapshot(asked, repo_id, revision, "dataset", ("README.md",))
    commit = os.path.basename(readme)
    files = ("README.md", *subset_files(os.path.join(readme, "README.md"), subset, asked[0]))
    return _snapshot(asked, repo_id, commit, "dataset", tuple(files), shown=revision)


def subset_files(readme: str, subset: str, where: str) -> list[str]:
    """The file patterns the dataset card ``readme`` gives ``subset`` under ``configs`` (every
    split's: ``datasets`` resolves them all); ``ValueError`` naming the subsets it has."""
    from huggingface_hub import DatasetCard

    configs = []
    if os.path.isfile(readme):
        configs = DatasetCard.load(readme).data.get("configs") or []
    found = next((c for c in configs if c.get("config_name") == subset), None)
    if found is None:
        names = [c.get("config_name") for c in configs]
        raise ValueError(
            f"{where}: the dataset has no subset {subset!r} (data.subset / data.eval_subset); "
            "its README names " + (f"{names}" if names else "none (drop data.subset)")
        )
    files = found.get("data_files") or []
    files = [files] if isinstance(files, (str, dict)) else files
    patterns: list[str] = []
    for entry in files:
        paths = entry.get("path") if isinstance(entry, dict) else entry
        patterns += [paths] if isinstance(paths, str) else list(paths or [])
    return patterns


def _snapshot(
    asked: tuple[str, str],
    repo_id: str,
    revision: str,
    kind: str,
    files: tuple[str, ...] | None,
    shown: str | None = None,
) -> str:
    """``snapshot_download`` of ``files`` (glob patterns; ``None``: all), its failures as one
    ``ValueError`` naming ``asked`` (the key and its revision's key; module docstring); one
    call per process and arguments."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    memo = (constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE, constants.ENDPOINT)
    memo += (repo_id, revision, kind, files)
    if memo in _MEMO:
        return _MEMO[memo]
    (where, revision_key), shown = asked, shown or revision
    name = f"Hub {kind} {repo_id}@{shown}"
    try:
        folder = snapshot_download(
            repo_id,
            repo_type=kind,
            revision=revision,
            allow_patterns=list(files or ["*"]),
            # offline, a commit's snapshot is read as the cache holds it (without this, a
            # commit hash sends snapshot_download to the Hub for the commit's file list)
            local_files_only=constants.HF_HUB_OFFLINE,
        )
    except RevisionNotFoundError:
        raise ValueError(
            f"{where}: the {name} has no revision {shown!r} (a branch, tag or commit; "
            f"{revision_key})"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise ValueError(
            f"{where}: {repo_id!r} is no local path and the Hub has no {kind} repository "
            f"{repo_id} this machine may read (a private or gated one needs `hf auth login` or "
            f"HF_TOKEN; a local path needs to exist): {type(error).__name__}"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        raise ValueError(_unreachable(where, repo_id, shown, kind, error)) from None
    except HfHubHTTPError as error:
        raise ValueError(f"{where}: fetching the {name} failed: {error}") from None
    _MEMO[memo] = folder
    return folder


def _unreachable(where: str, repo_id: str, revision: str, kind: str, error: Exception) -> str:
    from huggingface_hub import constants

    why = (
        "HF_HUB_OFFLINE is set"
        if constants.HF_HUB_OFFLINE
        else "the Hub cannot be reached (no network?)"
    )
    incomplete = type(error).__name__ == "IncompleteSnapshotError"
    held = "holds it only in part" if incomplete else "holds no copy"
    download = f"hf download {repo_id} --revision {revision}"
    download += " --repo-type dataset" if kind == "dataset" else ""
    return (
        f"{where}: {repo_id!r} is no local path, and the Hub {kind} {repo_id}@{revision} cannot "
        f"be fetched: {why} and the Hub cache {constants.HF_HUB_CACHE} {held}. Fix: connect "
        f"to the network{' and unset HF_HUB_OFFLINE' if constants.HF_HUB_OFFLINE else ''}; "
        f"or download it once where there is a network (`{download}`, `huggingface-cli "
        f"download` in older huggingface_hub) into that cache (HF_HUB_CACHE / HF_HOME); or set "
        f"{where} to a local folder"
    )


def hub_commits(recipe: Any) -> list[str]:
    """``key: id@commit`` of every input the recipe read from the Hub (the commit is its
    snapshot folder's name): what every rank must agree on."""
    out = []
    for section, key, _, _ in HUB_KEYS:
        values = getattr(recipe, section)
        written = values.from_hub.get(key)
        if written:
            match = _SNAPSHOT.search(str(getattr(values, key)))
            commit = match.group(1) if match else getattr(values, key)
            out.append(f"{section}.{key}: {written.rpartition('@')[0]}@{commit}")
    return out


def check_same_commits(gathered: list[list[str]]) -> None:
    """``ValueError`` (on every rank: ``gathered`` is every rank's :func:`hub_commits`, the same
    list everywhere) unless all ranks read the same inputs at the same commits."""
    if any(commits != gathered[0] for commits in gathered):
        raise ValueError(
            "the ranks read different inputs (a local path on some nodes only, or a branch "
            f"that moved while they resolved it): {gathered}; pin the revision to a commit "
            "(model.revision, data.revision, ...) or give every node the same local path"
        )
