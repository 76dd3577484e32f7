"""Once per ViT: the registry of what a ViT declares, how it is found and seen through wrappers,
its settings for a config (planner spec, merge size, layout token), the gate of every path and
the one answer to whether a call runs bands. Imports ``transport`` and ``bands``.
"""
