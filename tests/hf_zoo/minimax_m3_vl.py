"""MiniMax-M3-VL: a sparse MoE text model with 1-D positions (no mm_token_type_ids); one
``<vs> pads <ve>`` group per video frame. Each video is one grid row here (the real processor
cuts clips into rows of at most 4 frames)."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VIDEO, instantiate, qwen_style_batch


def build():
    config = transformers.MiniMaxM3VLConfig(
        vision_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
        ),
        text_config=dict(
            TEXT,
            hidden_size=96,
            intermediate_size=32,
            rotary_dim=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            layer_types=["full_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            num_local_experts=4,
            num_experts_per_tok=2,
            dense_intermediate_size=128,
            shared_intermediate_size=32,
            bos_token_id=1,
            eos_token_id=2,
        ),
        projector_hidden_size=128,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
    )
    return instantiate(transformers.MiniMaxM3SparseForConditionalGeneration, config)


def batch(model, images, videos, seed):
    c = model.config.vision_config
    width = c.num_channels * c.temporal_patch_size * c.patch_size**2
    return qwen_style_batch(
        model, images, videos, seed, per_frame_groups=True, token_types=False, row_shape=(width,)
    )
