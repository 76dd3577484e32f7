"""dots3-note: a tower with an MoE layer and the merger inside, a Conv2d patch embedding (a pixel
row is one frame's patch), 1-D text positions (no mm_token_type_ids); one group per clip."""

import transformers

from hf_zoo._common import IMAGE, VIDEO, instantiate, qwen_style_batch


def build():
    config = transformers.Dots3NoteConfig(
        vision_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            patch_size=14,
            spatial_merge_size=2,
            pyramid_num_routed=[-1, 4],  # layer 0 a dense MLP, layer 1 an MoE of 4 experts
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            adapter_in_dim=64,
            adapter_out_dim=96,
            adapter_merge_size=2,
        ),
        text_config=dict(
            vocab_size=256,
            hidden_size=96,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            shared_experts_intermediate_size=32,
            index_head_dim=16,
            index_n_heads=2,
            index_topk=16,
            use_dsa=False,
            use_sliding_window=False,  # plain MLA full attention in both layers
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        audio_config=dict(  # built, unused; its adapter's out width must equal the text width
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            feature_size=16,
            downsample_hidden_size=16,
            adapter_input_size=32,
            adapter_out_dim=96,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        audio_token_id=126,
    )
    return instantiate(transformers.Dots3NoteForConditionalGeneration, config)


def batch(model, images, videos, seed):
    c = model.config.vision_config
    width = c.num_channels * c.patch_size**2
    return qwen_style_batch(
        model, images, videos, seed, per_frame_groups=False, token_types=False, row_shape=(width,)
    )
