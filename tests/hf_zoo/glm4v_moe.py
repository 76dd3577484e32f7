"""GLM-4.5V: GLM-4.1V with an MoE text model (layer 0 dense); GLM layout, video frames use the
image token, so a sample holds images or videos, not both (MIXED_OK)."""

import transformers

from hf_zoo._common import GLM_TOKENS, GLM_VISION, glm_batch, glm_text, instantiate

MIXED_OK = False


def build():
    config = transformers.Glm4vMoeConfig(
        vision_config=dict(GLM_VISION),
        text_config=glm_text(
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        **GLM_TOKENS,
    )
    return instantiate(transformers.Glm4vMoeForConditionalGeneration, config)


batch = glm_batch
