"""A frame split across ranks, inside the ViT: what a tower running bands is told (``Bands``), each
rank's part of the exchange of their keys and values, and the ops that run it. Imports
``transport`` only.
"""
