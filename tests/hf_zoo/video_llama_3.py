"""VideoLLaMA3: its tower takes a merge size per grid row (1 for images, 2 for videos), so it is
refused."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VIDEO, instantiate


def build():
    config = transformers.VideoLlama3Config(
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            patch_size=14,
        ),
        text_config=dict(TEXT, hidden_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
    )
    return instantiate(transformers.VideoLlama3ForConditionalGeneration, config)
