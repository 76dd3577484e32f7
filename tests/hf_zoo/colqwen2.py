"""ColQwen2: a retriever around a Qwen2-VL model; its forward calls the tower itself, so it is
refused."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, instantiate, mrope


def build():
    config = transformers.ColQwen2Config(
        vlm_config=dict(
            model_type="qwen2_vl",
            vision_config=dict(depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2),
            text_config=dict(TEXT, bos_token_id=1, eos_token_id=2, rope_parameters=mrope()),
            **QWEN_TOKENS,
        ),
        embedding_dim=32,
    )
    config.vlm_config._attn_implementation = "sdpa"
    return instantiate(transformers.ColQwen2ForRetrieval, config)
