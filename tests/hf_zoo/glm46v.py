"""GLM-4.6V: GLM-4V's tower and text model (built from their sub-configs); GLM layout, video
frames use the image token, so a sample holds images or videos, not both (MIXED_OK)."""

import transformers

from hf_zoo._common import GLM_TOKENS, GLM_VISION, glm_batch, glm_text, instantiate

MIXED_OK = False


def build():
    config = transformers.Glm46VConfig(
        vision_config=dict(GLM_VISION), text_config=glm_text(), **GLM_TOKENS
    )
    return instantiate(transformers.Glm46VForConditionalGeneration, config)


batch = glm_batch
