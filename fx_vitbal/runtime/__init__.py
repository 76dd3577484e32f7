"""The runtime every path goes through: the gathered metadata and its checks (``metadata``), the
plan op (``planning``), routing (``routing``), the row exchange (``exchange``), the moving ops
and their autograd (``ops``), the agreed output layouts and status words (``layouts``,
``status``), and the one balanced call (``call``). Below it: ``fx_vitbal.plan``,
``fx_vitbal.cost`` and ``fx_vitbal.measure``; above it, the entry points.
"""
