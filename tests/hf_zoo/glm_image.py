"""GLM-Image: an image generator; the tower encodes source images whose output a frozen VQ-VAE
turns into code ids, so it is refused."""

import transformers

from hf_zoo._common import IMAGE, TEXT, instantiate, mrope

START, END = 96, 97  # image start/end, right after the 96 VQ code ids


def build():
    config = transformers.GlmImageConfig(
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            image_size=128,
            patch_size=16,
        ),
        text_config=dict(
            TEXT,
            vision_vocab_size=256,  # as the text vocabulary: the loss reshapes logits by it
            pad_token_id=0,
            eos_token_id=END,
            rope_parameters=mrope(),
        ),
        vq_config=dict(embed_dim=32, num_embeddings=96, latent_channels=64),
        image_token_id=IMAGE,
        image_start_token_id=START,
        image_end_token_id=END,
    )
    return instantiate(transformers.GlmImageForConditionalGeneration, config)
