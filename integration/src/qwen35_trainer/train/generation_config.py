"""The export's ``generation_config.json``: the ids that make ``generate`` stop at the end of an
assistant turn and pad the rows that stopped.

A chat model ends its answer with the chat template's end-of-turn token — ChatML's
``<|im_end|>`` (:data:`~qwen35_trainer.data.chat_turns.TURN_END`), the token the trainer labels
as each assistant turn's last (:mod:`qwen35_trainer.data.chat_turns`) — not necessarily the
tokenizer's end-of-text token. transformers' ``generate`` stops a row at any id of
``eos_token_id`` (an int or a list) and fills the rows that stopped with ``pad_token_id``; it
reads both from the model folder's ``generation_config.json`` (an eos in ``config.json``, where a
checkpoint has one, is the end-of-text token, not the end of a turn), and the inference servers
add its ``eos_token_id`` to their stop tokens. So the file is written with:

- ``eos_token_id``: the ids the source's own ``generation_config.json`` lists, then the
  end-of-turn id and the tokenizer's ``eos_token`` id where they are not among them (a list
  when there are several, as Qwen's releases write it);
- ``pad_token_id``: the source's, else the tokenizer's ``pad_token``, else the first eos id;
- every other field as the source's file has it (the release's sampling defaults); none
  without one.

The ids are read from the processor folder the export copies (its tokenizer, which the chat
template renders into). When the source's file already holds them all it is copied byte for
byte; a tokenizer without ``<|im_end|>`` (not a ChatML template) adds no end-of-turn id, and the
notes say so.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from qwen35_trainer.data.chat_turns import TURN_END

__all__ = ["GENERATION_CONFIG", "stop_ids", "write_generation_config"]

GENERATION_CONFIG = "generation_config.json"


def _token_id(tokenizer, token: str | None) -> int | None:
    """``token``'s id when the tokenizer holds it as one token (not its unknown token)."""
    if not token:
        return None
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or (found == tokenizer.unk_token_id and token != tokenizer.unk_token):
        return None
    return int(found)


def stop_ids(processor: Path) -> tuple[int | None, int | None, int | None]:
    """``(end-of-turn id, the tokenizer's eos id, its pad id)`` of the tokenizer in
    ``processor`` (``None`` for each it does not have)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(processor))
    return (
        _token_id(tokenizer, TURN_END),
        _token_id(tokenizer, tokenizer.eos_token),
        _token_id(tokenizer, tokenizer.pad_token),
    )


def _listed(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def write_generation_config(processor: Path, source: Path | None, out: Path) -> list[str]:
    """Write ``out/generation_config.json`` (module docstring) from the tokenizer in
    ``processor`` and the source's ``generation_config.json`` in ``source`` (``None``: none);
    the notes saying what it holds."""
    from transformers import GenerationConfig

    turn_end, eos, pad = stop_ids(processor)
    config = GenerationConfig.from_pretrained(str(source)) if source else GenerationConfig()
    listed = _listed(config.eos_token_id)
    eos_ids = listed + [
        i for i in dict.fromkeys((turn_end, eos)) if i is not None and i not in listed
    ]
    pad_id = next((i for i in (config.pad_token_id, pad, *eos_ids[:1]) if i is not None), None)
    origin = f" (the rest as {source / GENERATION_CONFIG})" if source else ""
    if not eos_ids:
        return [f"no {GENERATION_CONFIG}: the tokenizer in {processor} has no eos token"]
    notes = [
        f"{GENERATION_CONFIG}: eos_token_id {eos_ids} (end of turn {TURN_END} "
        f"{turn_end if turn_end is not None else 'absent: not a ChatML tokenizer'}), "
        f"pad_token_id {pad_id}{origin}"
    ]
    if source and eos_ids == listed and pad_id == config.pad_token_id:
        shutil.copyfile(source / GENERATION_CONFIG, out / GENERATION_CONFIG)
        return [f"{GENERATION_CONFIG} copied byte for byte from {source}: eos_token_id {eos_ids}"]
    config.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    config.pad_token_id = pad_id
    config.save_pretrained(str(out))
    return notes
