"""GLM-4.1V: GLM layout; video frames use the image token, so a sample holds images or
videos, not both (MIXED_OK)."""

import transformers

from hf_zoo._common import GLM_TOKENS, GLM_VISION, glm_batch, glm_text, instantiate

MIXED_OK = False


def build():
    config = transformers.Glm4vConfig(
        vision_config=dict(GLM_VISION), text_config=glm_text(), **GLM_TOKENS
    )
    return instantiate(transformers.Glm4vForConditionalGeneration, config)


batch = glm_batch
