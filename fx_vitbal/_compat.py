"""Every difference between the torch versions fx_vitbal supports (2.8 through 2.15), and
nothing else: the rest of the package calls these names and never checks a version."""

import torch
import torch._dynamo
import torch._inductor.config
import torch.distributed as dist

# (major, minor): NVIDIA's container builds (``2.13.0a0+...``) have their release's features.
_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])

# ``torch.compiler.assume_constant_result`` on a function of an ``nn.Module``: 2.13 traces it
# (seen on 2.13, 2.14 and 2.15); 2.8 and 2.11 raise "UnspecializedNNModuleVariable ... is not a
# constant".
DYNAMO_CALLS_ON_MODULES_ARE_CONSTANTS = _VERSION >= (2, 13)

# ``all_gather_single`` is 2.13+; ``all_gather_into_tensor`` has the same signature and
# semantics since 1.13, and warns (deprecated) from 2.13 on.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_single(output, input, group) -> None:
    """Gather ``input`` from every rank of ``group`` into ``output`` (rank-major, one flat
    tensor of ``world * input.numel()`` values)."""
    _all_gather_single(output, input, group=group)


def keep_nested_compile_regions() -> None:
    """Make dynamo keep a function marked ``torch.compiler.nested_compile_region`` as one
    ``invoke_subgraph`` node even when it is called once (how ``passes/subgraph.py`` finds a
    ViT). From 2.13 on, dynamo inlines single-use regions unless told not to; before, it never
    did and the setting does not exist."""
    if hasattr(torch._dynamo.config, "inline_single_use_invoke_subgraph"):
        torch._dynamo.config.inline_single_use_invoke_subgraph = False


# Ops with this tag are kept out of CUDA graphs by inductor's graph partitioning
# (``mode="reduce-overhead"``): the balancing ops' sizes and collectives change every step, so a
# replay would reuse the recorded split sizes and skip the status checks. The same on every
# supported torch (checked on 2.8, 2.13 and 2.15): one name for the three ops.
CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,)

# Inductor settings a graph holding balancing ops needs, applied by the ``vitbal`` backend to its
# inner inductor compile. Triton's mix-order reduction (a fusion heuristic, on by default where
# it exists) asks for a size hint of the balanced batch's unbacked row count and fails with
# "Cannot convert symbols to int" (seen on torch 2.11 + CUDA). No later torch has run on a GPU
# here yet, so it is off wherever the setting exists; it only touches Triton (GPU) kernels.
INDUCTOR_CONFIG_PATCHES = (
    {"triton.mix_order_reduction": False}
    if hasattr(torch._inductor.config.triton, "mix_order_reduction")
    else {}
)
