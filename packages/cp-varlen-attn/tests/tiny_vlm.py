"""A tiny transformers Qwen3.5-MoE VLM and three documents for the drop-in tests: text only,
text + image, text + a 2-frame video (frames split by a text token, as the processor does); and
:func:`processor_document`, which writes any mix of text, images and videos as Qwen3.5's
processor does."""

from __future__ import annotations

import torch

IMAGE, VIDEO, START, END = 120, 121, 122, 123
PATCH = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch


def tiny_vlm(seed: int = 0):
    import transformers

    config = transformers.Qwen3_5MoeConfig(
        text_config=dict(
            vocab_size=128, hidden_size=32, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, pad_token_id=0,
        ),
        vision_config=dict(depth=1, hidden_size=32, num_heads=4, patch_size=2, out_hidden_size=32,
                           num_position_embeddings=16, intermediate_size=32),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def documents(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(1, 100, (n,), generator=g)

    patch = PATCH
    image_ids = torch.cat([text(5), torch.tensor([START, *[IMAGE] * 4, END]), text(4)])
    frame = torch.tensor([START, *[VIDEO] * 4, END])
    video_ids = torch.cat([text(3), frame, text(1), frame, text(6)])
    return [
        {"input_ids": text(9)},
        {
            "input_ids": image_ids[None],
            "pixel_values": torch.randn(16, patch, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
        },
        {
            "input_ids": video_ids[None],
            "pixel_values_videos": torch.randn(32, patch, generator=g),
            "video_grid_thw": torch.tensor([[2, 4, 4]]),
        },
    ]


def processor_document(parts: list[tuple], *, merge: int = 2, seed: int = 0) -> dict:
    """One document of ``parts`` — ``("text", n)``, ``("image", (t, a, b))``, ``("video", (t, a,
    b))`` with the grid ``(t, a·merge, b·merge)`` — written as Qwen3.5's processor does: an image
    is ``<vision_start> image pads <vision_end>``; a video, per frame, 3 timestamp text tokens
    then ``<vision_start> video pads <vision_end>``. With ``mm_token_type_ids``, the grids and
    random pixels (one row per patch)."""
    g = torch.Generator().manual_seed(seed)
    ids, grids = [], {"image": [], "video": []}
    for kind, spec in parts:
        if kind == "text":
            ids.append(torch.randint(1, 100, (spec,), generator=g))
            continue
        t, a, b = spec
        grids[kind].append((t, a * merge, b * merge))
        if kind == "image":
            ids.append(torch.tensor([START, *[IMAGE] * (t * a * b), END]))
        else:
            for _ in range(t):
                ids.append(torch.randint(1, 100, (3,), generator=g))  # "<0.5 seconds>"
                ids.append(torch.tensor([START, *[VIDEO] * (a * b), END]))
    input_ids = torch.cat(ids)
    doc = {
        "input_ids": input_ids,
        "mm_token_type_ids": (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long(),
    }
    for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                               ("video", "pixel_values_videos", "video_grid_thw")):  # fmt: skip
        if grids[kind]:
            doc[grid] = torch.tensor(grids[kind])
            doc[pixels] = torch.randn(int(doc[grid].prod(-1).sum()), PATCH, generator=g)
    return doc


def mixed_document(seed: int = 0) -> dict:
    """Text, a 4x4 image, a 2-frame 4x2 video, a non-square 2x4 image and a 3-frame video."""
    return processor_document(
        [("text", 3), ("image", (1, 2, 2)), ("text", 2), ("video", (2, 2, 1)), ("text", 2),
         ("image", (1, 1, 2)), ("video", (3, 1, 1)), ("text", 1)],
        seed=seed,
    )  # fmt: skip
