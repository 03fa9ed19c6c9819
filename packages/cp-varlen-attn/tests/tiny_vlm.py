"""A tiny transformers Qwen3.5-MoE VLM and three documents for the drop-in tests: text only,
text + image, text + a 2-frame video (frames split by a text token, as the processor does)."""

from __future__ import annotations

import torch

IMAGE, VIDEO, START, END = 120, 121, 122, 123


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

    patch = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
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
