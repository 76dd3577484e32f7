"""Tiny random models of the Hugging Face VLM families whose modeling code uses ``grid_thw``, one
module per transformers ``model_type``, each with ``build()`` (the family's generating model,
seeded, float32, in training mode) and, for the families that are balanced,
``batch(model, images, videos, seed)`` (the keyword arguments of one sample holding those
``(t, h, w)`` grid rows, with the family's placeholder tokens). ``_common`` holds what they
share. No downloads: every model is built from its config classes, scaled down."""
