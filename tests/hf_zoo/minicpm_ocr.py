"""MiniCPM-OCR: its tower takes ``target_sizes`` and NaViT-packed pixels, no ``grid_thw``, so it
is refused. MiniCPM-V 4.6 and 4.7 share its tower and build through ``build``."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VIDEO, instantiate, linear_attention, mrope


def build(config_cls="MiniCPMOcrConfig", model_cls="MiniCPMOcrForConditionalGeneration", **extra):
    config = getattr(transformers, config_cls)(
        text_config=dict(
            TEXT,
            hidden_size=96,
            **linear_attention(),
            rope_parameters=mrope(mrope_interleaved=True, partial_rotary_factor=1.0),
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            patch_size=14,
            image_size=224,  # 16x16 learned positions
        ),
        insert_layer_id=0,  # the window-attention merger after layer 0 of 2 ("16x" mode)
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        **extra,
    )
    return instantiate(getattr(transformers, model_cls), config)
