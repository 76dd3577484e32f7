"""GLM-5.3-Flash: GLM-4V's tower without learned positions; a text model of MLA, linear attention,
MoE and hyper-connection streams with 1-D positions. Begin/end-of-video spans tell video frames
from images, so a sample may hold both."""

import transformers

from hf_zoo._common import GLM_TOKENS, VISION, glm_batch, instantiate


def build():
    config = transformers.Glm5NextConfig(
        vision_config=dict(VISION, projection_intermediate_size=128),
        text_config=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,  # the architecture requires as many KV heads as heads
            layer_types=["linear_attention", "indexed_attention"],
            mlp_layer_types=["dense", "sparse"],
            indexer_types=["full", "full"],
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            qk_rope_head_dim=0,
            index_topk=16,
            index_kpool=4,
            index_head_dim=16,
            index_n_heads=2,
            linear_head_dim=16,
            linear_num_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            hc_mult=2,
            pad_token_id=0,
        ),
        **GLM_TOKENS,
    )
    return instantiate(transformers.Glm5NextForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return glm_batch(model, images, videos, seed, mixed_ok=True)
