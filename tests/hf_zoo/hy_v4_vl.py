"""HY-V4-VL: its tower merges each frame on its own and adds a newline row after each line of
merged patches (``t * h/2 * (w/2 + 1)`` output rows per grid row); one placeholder span per image
and per video, typed 1 and 2 for its multimodal RoPE."""

import transformers

from hf_zoo._common import IMAGE, VIDEO, _sample, add_pixels, instantiate, mrope


def build():
    config = transformers.HYV4VLConfig(
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_hidden_layers=2,
            patch_size=16,
            spatial_merge_size=2,
            max_image_size=256,
            out_hidden_size=96,
        ),
        text_config=dict(
            vocab_size=256,
            hidden_size=96,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            index_topk=16,
            index_head_dim=16,
            index_n_heads=2,
            hc_mult=2,
            mlp_layer_types=["dense", "sparse"],
            indexer_types=["full", "shared"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters=mrope(),
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
    )
    # The text attention (sinks and a DSA indexer) supports eager only.
    return instantiate(
        transformers.HYV4VLForConditionalGeneration, config, attn="eager", vision_attn="sdpa"
    )


def batch(model, images, videos, seed):
    vc = model.config.vision_config
    merge = vc.spatial_merge_size
    ids, types = [5, 6], [0, 0]
    for token, kind, grids in ((IMAGE, 1, images), (VIDEO, 2, videos)):
        for t, h, w in grids:
            n = t * (h // merge) * (w // merge + 1)
            ids += [token] * n + [7]
            types += [kind] * n + [0]
    ids += [9, 10, 11]
    types += [0, 0, 0]
    width = vc.num_channels * vc.patch_size**2
    return add_pixels(_sample(ids, types), images, videos, seed, (width,))
