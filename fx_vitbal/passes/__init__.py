"""Graph-level delivery of fx_vitbal: the FX pass and the ``vitbal`` torch.compile backend."""

from fx_vitbal.passes.vit_balance import ViTLeafTracer, apply_vit_balance_pass, symbolic_trace

__all__ = ["apply_vit_balance_pass", "symbolic_trace", "ViTLeafTracer"]
