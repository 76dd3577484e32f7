"""Step3p7: its tower takes same-size NCHW views (a global view and local crops, two calls a
step), no ``grid_thw``, so it is refused."""

import transformers

from hf_zoo._common import IMAGE, TEXT, instantiate


def build():
    config = transformers.Step3p7Config(
        vision_config=dict(
            hidden_size=64,
            mlp_ratio=2.0,
            num_hidden_layers=2,
            num_attention_heads=4,
            patch_size=14,
            image_size=14 * 8,  # a global view of 8x8 patches
        ),
        text_config=dict(
            TEXT,
            hidden_size=96,
            num_local_experts=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            share_expert_dim=32,
            mlp_layer_types=["dense", "sparse"],
            layer_types=["full_attention", "sliding_attention"],
            sliding_window=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        image_token_id=IMAGE,
    )
    return instantiate(transformers.Step3p7ForConditionalGeneration, config)
