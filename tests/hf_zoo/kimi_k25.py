"""Kimi-K2.5: its tower attends across a clip's frames and averages them (``h*w/4`` rows of
shape ``(4, C)`` per grid row whatever ``t`` is); pixel rows are ``(3, p, p)`` patches; one
placeholder group per image and per clip."""

import transformers

from hf_zoo._common import IMAGE, QWEN_TOKENS, VEND, VIDEO, VSTART, _sample, add_pixels, instantiate


def build():
    config = transformers.Kimi_K25Config(
        vision_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            pos_emb_height=8,
            pos_emb_width=8,
            pos_emb_time=4,
        ),
        text_config=dict(
            model_type="deepseek_v3",
            vocab_size=256,
            hidden_size=96,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=16,
            head_dim=8,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        projection_hidden_size=64,
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Kimi_K25ForConditionalGeneration, config)


def batch(model, images, videos, seed):
    vc = model.config.vision_config
    merge = vc.merge_kernel_size[0] * vc.merge_kernel_size[1]
    ids = [5, 6]
    for token, grids in ((IMAGE, images), (VIDEO, videos)):
        for _, h, w in grids:
            ids += [VSTART] + [token] * (h * w // merge) + [VEND, 7]
    ids += [9, 10, 11]
    return add_pixels(_sample(ids), images, videos, seed, (3, vc.patch_size, vc.patch_size))
