"""Inkling2: images only; its grids count LM tokens, each pixel row is one token's
``(m*p, m*p, C)`` block, and its tower keeps a class row per image in ``last_hidden_state``
(its parent reads ``pooler_output``, one row per token)."""

import transformers

from hf_zoo._common import IMAGE, _sample, add_pixels, instantiate


def build(config_cls="Inkling2Config", model_cls="Inkling2ForConditionalGeneration", **text):
    """The model; Inkling2-Loop passes its own class names and extra text fields."""
    config = getattr(transformers, config_cls)(
        text_config=dict(
            vocab_size=256,
            unpadded_vocab_size=256,
            hidden_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            sliding_window_size=16,
            d_rel=16,
            rel_extent=32,
            layer_types=["hybrid_sliding", "hybrid"],
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            **text,
        ),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            patch_size=14,
            spatial_merge_size=2,
            posemb_grid_size=16,
            projection_hidden_dim=128,
            text_hidden_size=96,
        ),
        image_token_id=IMAGE,
    )
    # The text model (relative-position bias, sinks) supports eager attention only.
    model = getattr(transformers, model_cls)
    return instantiate(model, config, attn="eager", vision_attn="sdpa")


def batch(model, images, videos, seed):
    vc = model.config.vision_config
    ids = [5, 6]
    for t, h, w in images:
        ids += [IMAGE] * (t * h * w) + [7]
    ids += [9, 10, 11]
    side = vc.spatial_merge_size * vc.patch_size
    return add_pixels(_sample(ids), images, [], seed, (side, side, vc.num_channels))
