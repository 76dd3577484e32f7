"""Tools around the library, not on a training step's path: reference models written to the ViT
contract (``models``), the planning simulators (``simulate``, ``simulate_online``,
``simulate_replicas``), synthetic workloads (``workloads``) and the ViT self-check (``check``,
public as ``fx_vitbal.check_vision_encoder``)."""
