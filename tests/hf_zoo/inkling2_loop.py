"""Inkling2-Loop: Inkling2 with looped text layers and Inkling2's tower and batches."""

from hf_zoo import inkling2

batch = inkling2.batch


def build():
    return inkling2.build(
        "Inkling2LoopConfig",
        "Inkling2LoopForConditionalGeneration",
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=2,
        loop_num_passes=2,
        loop_gate_rank=16,
    )
