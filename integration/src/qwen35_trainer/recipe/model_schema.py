"""The ``model`` section of a recipe: the transformers config of the Qwen3.5 MoE-VLM, where its
weights come from, its kernels, LoRA (:class:`LoRARecipe`) and the frozen base's storage
(FP8, :class:`ModelRecipe`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from qwen35_trainer.recipe.rules import is_int, refuse

__all__ = ["LORA_TARGETS", "LoRARecipe", "ModelRecipe"]

# What model.lora.targets may name: the decoder's (and the MTP head's) projections, the shared
# expert's, and the routed experts (grouped adapters inside the expert computation).
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "experts",
)


@dataclasses.dataclass(frozen=True)
class LoRARecipe:
    """Low-rank adapters instead of full fine-tuning (:mod:`qwen35_trainer.model.lora.adapters`): every
    weight stays frozen and each target projection ``W`` computes ``W x + s · B A drop(x)``
    with ``A`` [rank, in], ``B`` [out, rank] (zero at the start: the model starts as the base),
    ``s = alpha / rank`` (``rslora``: ``alpha / sqrt(rank)``) and ``dropout`` on the adapter's
    input. ``targets``: module names (:data:`LORA_TARGETS`; every one must match a module of
    the model): the attention's ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, the Gated
    DeltaNet's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``out_proj``,
    the shared expert's ``gate_proj`` / ``up_proj`` / ``down_proj``, and ``experts``: the
    routed experts, one adapter pair per expert and projection (A [E, rank, in], B [E, out,
    rank]) applied inside the grouped expert computation, of rank ``expert_rank`` (``None``:
    ``rank``). ``train_modules``: modules trained in full beside the adapters (PEFT's
    ``modules_to_save``): a name matches every module whose name ends with it (PEFT's rule) —
    ``mlp.gate`` (the routers), ``embed_tokens``, ``lm_head``, ``norm`` (every norm),
    ``visual`` (or ``visual.merger``), ``mtp`` (the multi-token-prediction head); each must match
    a module, none may hold an adapter. Everything else stays frozen. ``init_from``: an adapter
    folder (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``, this trainer's
    export or PEFT's own, relative to the recipe file) the adapters — and the modules it saved
    in full — start from instead of ``B = 0``; its ranks and targets must be the recipe's (its
    scale is converted: :mod:`qwen35_trainer.model.lora.peft_import`)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    expert_rank: int | None = None
    rslora: bool = False
    train_modules: tuple[str, ...] = ()
    init_from: str | None = None

    def __post_init__(self) -> None:
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        refuse(
            "model.lora",
            {
                "rank": (is_int(self.rank) and self.rank >= 1, "an integer >= 1"),
                "alpha": (self.alpha > 0, "> 0"),
                "dropout": (0.0 <= self.dropout < 1.0, "in [0, 1)"),
                "expert_rank": (
                    self.expert_rank is None
                    or (is_int(self.expert_rank) and self.expert_rank >= 1),
                    "an integer >= 1, or null for model.lora.rank",
                ),
                "targets": (
                    bool(self.targets) and not unknown,
                    f"a non-empty list of {list(LORA_TARGETS)}"
                    + (f" (unknown: {unknown})" if unknown else ""),
                ),
                "train_modules": (
                    all(
                        isinstance(n, str) and n and not n.startswith(".")
                        for n in self.train_modules
                    )
                    and len(set(self.train_modules)) == len(self.train_modules),
                    "a list of distinct module names (e.g. [lm_head, mlp.gate])",
                ),
            },
            self,
        )

    @property
    def experts_rank(self) -> int:
        """The routed experts' adapter rank."""
        return self.expert_rank or self.rank


BASE_DTYPES = ("auto", "fp8")
DEFAULT_FP8_BLOCK = (128, 128)  # the blocks of a bf16 checkpoint quantized on load
# what the trainer reads of a checkpoint's quantization_config: key -> (accepted, what to say)
_QUANTIZATION = {
    "quant_method": (("fp8",), "'fp8' (block-scaled FP8, as Qwen's FP8 releases)"),
    "fmt": (("e4m3",), "'e4m3' (float8_e4m3fn)"),
    "activation_scheme": (
        ("dynamic",),
        "'dynamic' (a 'static' scheme stores activation scales that a weight-only "
        "dequantized GEMM would not apply)",
    ),
}


def quantization_problems(quantization: Any) -> None:
    """``ValueError`` naming every key of a checkpoint's ``quantization_config`` the trainer
    cannot read: its method, format, activation scheme, and ``weight_block_size`` (two
    integers >= 1; per-tensor scales, ``null``, are not read)."""
    if not isinstance(quantization, dict):
        raise ValueError(f"model.quantization must be a mapping, got {quantization!r}")
    bad = [
        f"model.quantization.{key} must be {what}, got {quantization.get(key)!r}"
        for key, (accepted, what) in _QUANTIZATION.items()
        if quantization.get(key) not in accepted
    ]
    block = quantization.get("weight_block_size")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(is_int(n) and n >= 1 for n in block)
    ):
        bad.append(
            f"model.quantization.weight_block_size must be [rows, columns], integers >= 1, got "
            f"{block!r}"
        )
    if bad:
        raise ValueError(
            "the checkpoint's quantization_config (config.json) is not one the trainer reads: "
            + "; ".join(bad)
        )


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """``text`` / ``vision``: keyword arguments of ``Qwen3_5MoeTextConfig`` /
    ``Qwen3_5MoeVisionConfig``; the token ids place image tokens inside the vocabulary.

    ``path``: a transformers checkpoint directory, the source of truth: its ``config.json``
    fills ``text``, ``vision`` and the token ids (a value the recipe states must equal it), its
    safetensors are the starting weights and its processor the data's
    (:mod:`qwen35_trainer.recipe.model_path`); ``override``: deliberate changes to ``config.json``
    (``text`` / ``vision`` mappings, token ids). ``weights``: without ``path``, a transformers
    checkpoint directory to start from whose config the recipe states (same architecture).
    ``path`` may name a Hugging Face Hub model repository (``org/name``) read at ``revision``
    (a branch, tag or commit; ``None``: ``main``) when no local path of that name exists: it
    resolves to its snapshot in the Hub cache when the recipe is built, and ``from_hub``
    records ``{path: org/name@revision}`` (:mod:`qwen35_trainer.recipe.hub`).

    ``mtp_layers``: depth of the multi-token-prediction head (``mtp.*``, :mod:`qwen35_trainer.
    model.mtp`); ``None`` takes ``text.mtp_num_hidden_layers`` (1 in the public checkpoints, 0
    when absent), 0 turns it off (nothing trained, none exported). ``init_missing_mtp``: a
    starting checkpoint without ``mtp.*`` tensors is an error while the head is on, unless this
    is true: then the head starts from the name-seeded initialisation (logged).

    Kernels (:mod:`qwen35_trainer.model.kernels`): ``attention_backend`` (``auto``, ``torch``,
    ``flash``), ``gdn_backend`` (``auto``, ``torch``, ``fla``), ``expert_backend`` (``auto``,
    ``torch``, ``te``); ``auto`` takes the fast GPU kernel when it is installed and the run is on
    CUDA, a named one that cannot run is an error.

    ``lora``: train low-rank adapters on a frozen model instead of every weight
    (:class:`LoRARecipe`); ``None``: full fine-tuning.

    The frozen base in block-scaled FP8 (:mod:`qwen35_trainer.model.fp8.hold`): ``quantization`` is
    the checkpoint's ``quantization_config`` (read from ``model.path``'s ``config.json``; stated
    with ``model.weights``): Qwen's FP8 releases, ``quant_method: fp8``, ``fmt: e4m3``,
    ``activation_scheme: dynamic`` and ``weight_block_size [rows, columns]``. With ``lora``,
    such a checkpoint's converted projections stay FP8 as stored; without, they are
    dequantized into the trained weights. ``base_dtype``: ``auto`` (that rule; any other
    checkpoint's frozen base in the training dtype) or ``fp8``: the frozen projections held in
    FP8 whatever the checkpoint holds — a bf16 checkpoint's quantized on load in blocks of
    ``fp8_block`` (default 128 × 128; an FP8 checkpoint keeps its own, and a ``fp8_block``
    that disagrees with them is an error) — LoRA only: an FP8 weight cannot take an optimizer
    step. From an FP8 checkpoint the modules held in FP8 are exactly those it stores in
    float8 (:func:`qwen35_trainer.model.weights.adapter.fp8_weights`): a module it keeps in
    bf16 (its ``modules_to_not_convert``) stays bf16.

    ``stored_dtype``: the dtype the checkpoint's weights are stored in (``config.json``'s
    ``dtype``, or ``torch_dtype``; read with ``model.path``, stated or ``None`` with
    ``model.weights``): what an export writes unless told otherwise."""

    text: dict[str, Any]
    vision: dict[str, Any]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    expert_backend: str = "auto"
    attention_backend: str = "auto"
    gdn_backend: str = "auto"
    weights: str | None = None
    path: str | None = None
    revision: str | None = None
    from_hub: dict[str, str] = dataclasses.field(default_factory=dict)
    override: dict[str, Any] = dataclasses.field(default_factory=dict)
    mtp_layers: int | None = None
    init_missing_mtp: bool = False
    lora: LoRARecipe | None = None
    base_as_written: str | None = None
    base_dtype: str = "auto"
    fp8_block: tuple[int, int] | None = None
    quantization: dict[str, Any] | None = None
    stored_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.path and self.weights:
            raise ValueError(
                "model.weights and model.path are two sources of weights: with "
                "model.path the weights are its safetensors (drop model.weights)"
            )
        depth = self.text.get("mtp_num_hidden_layers", 0)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(
                f"model.text.mtp_num_hidden_layers must be an integer >= 0, got {depth!r}"
            )
        refuse(
            "model",
            {
                "mtp_layers": (
                    self.mtp_layers is None
                    or (
                        isinstance(self.mtp_layers, int)
                        and not isinstance(self.mtp_layers, bool)
                        and self.mtp_layers >= 0
                    ),
                    "an integer >= 0, or null for model.text.mtp_num_hidden_layers",
                ),
                "base_dtype": (self.base_dtype in BASE_DTYPES, f"one of {BASE_DTYPES}"),
                "fp8_block": (
                    self.fp8_block is None
                    or (
                        isinstance(self.fp8_block, list | tuple)
                        and len(self.fp8_block) == 2
                        and all(is_int(n) and n >= 1 for n in self.fp8_block)
                    ),
                    "[rows, columns], integers >= 1 (null: 128 x 128)",
                ),
            },
            self,
        )
        if self.quantization is not None:
            quantization_problems(self.quantization)
            stored = list(self.quantization["weight_block_size"])
            if self.fp8_block is not None and list(self.fp8_block) != stored:
                raise ValueError(
                    f"model.fp8_block {list(self.fp8_block)} disagrees with the FP8 checkpoint's "
                    f"blocks, quantization_config.weight_block_size {stored} (config.json): an "
                    "FP8 checkpoint keeps its own blocks; drop model.fp8_block"
                )
        if self.base_dtype == "fp8" and self.lora is None:
            raise ValueError(
                "model.base_dtype=fp8 needs model.lora: FP8 holds a frozen base that trains "
                "through adapters; a weight that trains itself needs its own precision for "
                "the optimizer's small steps (drop model.base_dtype to fine-tune in full; an "
                "FP8 checkpoint is then dequantized into the trained weights)"
            )

    @property
    def fp8_base(self) -> bool:
        """Whether the frozen base is held in FP8 (class docstring)."""
        return self.lora is not None and (self.base_dtype == "fp8" or self.quantization is not None)

    @property
    def block(self) -> tuple[int, int]:
        """The FP8 blocks: the checkpoint's ``weight_block_size``, else ``fp8_block``, else
        128 × 128."""
        if self.quantization is not None:
            return tuple(self.quantization["weight_block_size"])
        return tuple(self.fp8_block) if self.fp8_block is not None else DEFAULT_FP8_BLOCK

    @property
    def mtp_depth(self) -> int:
        """The multi-token-prediction layers the model has: ``mtp_layers``, else the text
        config's ``mtp_num_hidden_layers`` (0 when absent)."""
        if self.mtp_layers is not None:
            return self.mtp_layers
        return int(self.text.get("mtp_num_hidden_layers", 0))

    @property
    def weights_dir(self) -> str | None:
        """Where the starting weights are read from (``None``: name-seeded initialisation)."""
        return self.path or self.weights
