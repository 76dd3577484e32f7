"""The FX pass: graph snapshots, idempotence, refusals, and exact results on 2 gloo ranks."""

import operator

import pytest
import torch
from dist_utils import assert_units_moved, fullgraph_capture, record_moves, run_ranks, train_step
from expecttest import TestCase

from fx_vitbal import BalanceConfig
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel

# Fixed group and world size: they are literals in the rewritten graph.
FIXED = {"group_name": "0", "world_size": 2}
QUADRATIC = BalanceConfig(cost_model="quadratic")  # a short planner literal in snapshots


def _model(**vit) -> OmniEncoderModel:
    torch.manual_seed(0)
    return OmniEncoderModel(ViTConfig(**vit), LMConfig(num_layers=1))


def _head(code: str, lines: int) -> str:
    """The first lines of generated code: the ViT call and its rewiring live there."""
    return "\n".join(line.rstrip() for line in code.strip().splitlines()[:lines])


class TestGraphs(TestCase):
    def test_trace_keeps_the_vit_as_one_call_module_leaf(self):
        gm = symbolic_trace(_model(deepstack_indexes=(0,)))
        calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
        self.assertEqual(calls.count("visual"), 1)
        self.assertFalse(any(t.startswith("visual.") for t in calls))

    def test_deepstack_graph_before_and_after(self):
        gm = symbolic_trace(_model(deepstack_indexes=(0,)))
        self.assertExpectedInline(
            _head(gm.code, 5),
            """\
def forward(self, input_ids : torch.Tensor, pixel_values : torch.Tensor, image_grid_thw : torch.Tensor) -> torch.Tensor:
    visual = self.visual(pixel_values, image_grid_thw);  pixel_values = image_grid_thw = None
    getitem = visual[0]
    getitem_1 = visual[2];  visual = None
    getitem_2 = getitem_1[0];  getitem_1 = None""",
        )
        apply_vit_balance_pass(gm, config=QUADRATIC, **FIXED)
        self.assertExpectedInline(
            _head(gm.code, 25),
            """\
def forward(self, input_ids : torch.Tensor, pixel_values : torch.Tensor, image_grid_thw : torch.Tensor) -> torch.Tensor:
    visual_1 = self.visual
    call_inputs = fx_vitbal_runtime_call_call_inputs(visual_1, pixel_values, image_grid_thw, '0');  pixel_values = image_grid_thw = None
    getitem_10 = call_inputs[0]
    getitem_11 = call_inputs[1]
    getitem_12 = call_inputs[2];  call_inputs = None
    in_balancing_mode = fx_vitbal_runtime_vit_settings_in_balancing_mode(visual_1, 'training')
    layout_token = fx_vitbal_runtime_vit_settings_layout_token(visual_1);  visual_1 = None
    runs_bands = fx_vitbal_runtime_vit_settings_runs_bands('{"bands": {"align": 2, "compiled": true, "exchange_layers": 2, "heads": 4, "kv_bytes_per_patch": 128, "min_patches": 1024}, "config": {"band_exchange": "auto", "cost_coeffs": null, "cost_model": "quadratic", "enabled": true, "max_iters": 20, "max_len_ratio": null, "memory_budget": null, "min_band_patches": 1024, "min_gain": 0.02, "skip_rule": "no-gain", "split_frames": true, "split_images": true, "strategy": "min-move", "tolerance": 0.05, "trigger_threshold": 0.2, "verbose": false, "when": "training"}, "cost": "{\\\\"kind\\\\": \\\\"quadratic\\\\"}", "routing": 10}')
    plan_default = torch.ops.vitbal.plan.default(getitem_10, getitem_11, 2, '{"bands": {"align": 2, "compiled": true, "exchange_layers": 2, "heads": 4, "kv_bytes_per_patch": 128, "min_patches": 1024}, "config": {"band_exchange": "auto", "cost_coeffs": null, "cost_model": "quadratic", "enabled": true, "max_iters": 20, "max_len_ratio": null, "memory_budget": null, "min_band_patches": 1024, "min_gain": 0.02, "skip_rule": "no-gain", "split_frames": true, "split_images": true, "strategy": "min-move", "tolerance": 0.05, "trigger_threshold": 0.2, "verbose": false, "when": "training"}, "cost": "{\\\\"kind\\\\": \\\\"quadratic\\\\"}", "routing": 10}', 2, '0', in_balancing_mode, layout_token, getitem_12, False, None, runs_bands);  getitem_11 = in_balancing_mode = layout_token = getitem_12 = None
    getitem_13 = plan_default[0]
    getitem_14 = plan_default[1];  plan_default = None
    redistribute_default = torch.ops.vitbal.redistribute.default([getitem_10], getitem_14, 4, [4], None, '0')
    getitem_15 = redistribute_default[0];  redistribute_default = None
    bands_for_vit = fx_vitbal_runtime_bands_view_bands_for_vit(getitem_14, getitem_13, '0', runs_bands);  runs_bands = None
    visual = self.visual(getitem_15, getitem_13, vitbal_bands = bands_for_vit);  getitem_13 = bands_for_vit = None
    getitem_16 = visual[0]
    getitem_17 = visual[2];  visual = None
    getitem_18 = getitem_17[0];  getitem_17 = None
    size = getitem_15.size(0);  getitem_15 = None
    output_block_rows = fx_vitbal_runtime_transport_ops_output_block_rows([getitem_16, getitem_18], size, 4);  size = None
    size_1 = getitem_10.size(0);  getitem_10 = None
    home_rows = fx_vitbal_runtime_transport_ops_home_rows(output_block_rows, size_1, 4);  size_1 = None
    no_backward_will_come = fx_vitbal_runtime_transport_ops_no_backward_will_come([getitem_16, getitem_18])
    restore_default = torch.ops.vitbal.restore.default([getitem_16, getitem_18], getitem_14, 4, output_block_rows, home_rows, '0', True, no_backward_will_come);  getitem_16 = getitem_18 = getitem_14 = output_block_rows = home_rows = no_backward_will_come = None""",
        )

    def test_window_graph_regenerates_window_index_from_the_original_grid(self):
        gm = symbolic_trace(_model(window_size=2, fullatt_block_indexes=(1,)))
        self.assertExpectedInline(
            _head(gm.code, 10),
            """\
def forward(self, input_ids : torch.Tensor, pixel_values : torch.Tensor, image_grid_thw : torch.Tensor) -> torch.Tensor:
    visual = self.visual(pixel_values, image_grid_thw);  pixel_values = image_grid_thw = None
    getitem = visual[0]
    getitem_1 = visual[1];  visual = None
    argsort = torch.argsort(getitem_1);  getitem_1 = None
    unflatten = getitem.unflatten(0, (-1, 4));  getitem = None
    getitem_2 = unflatten[argsort];  unflatten = argsort = None
    flatten = getitem_2.flatten(0, 1);  getitem_2 = None
    projector_norm = self.projector.norm(flatten);  flatten = None
    unflatten_1 = projector_norm.unflatten(0, (-1, 4));  projector_norm = None""",
        )
        apply_vit_balance_pass(gm, config=QUADRATIC, **FIXED)
        self.assertExpectedInline(
            _head(gm.code, 25),
            """\
def forward(self, input_ids : torch.Tensor, pixel_values : torch.Tensor, image_grid_thw : torch.Tensor) -> torch.Tensor:
    visual_1 = self.visual
    call_inputs = fx_vitbal_runtime_call_call_inputs(visual_1, pixel_values, image_grid_thw, '0');  pixel_values = image_grid_thw = None
    getitem_10 = call_inputs[0]
    getitem_11 = call_inputs[1]
    getitem_12 = call_inputs[2];  call_inputs = None
    in_balancing_mode = fx_vitbal_runtime_vit_settings_in_balancing_mode(visual_1, 'training')
    layout_token = fx_vitbal_runtime_vit_settings_layout_token(visual_1);  visual_1 = None
    runs_bands = fx_vitbal_runtime_vit_settings_runs_bands('{"bands": {"align": 4, "compiled": true, "exchange_layers": 1, "heads": 4, "kv_bytes_per_patch": 128, "min_patches": 1024}, "config": {"band_exchange": "auto", "cost_coeffs": null, "cost_model": "quadratic", "enabled": true, "max_iters": 20, "max_len_ratio": null, "memory_budget": null, "min_band_patches": 1024, "min_gain": 0.02, "skip_rule": "no-gain", "split_frames": true, "split_images": true, "strategy": "min-move", "tolerance": 0.05, "trigger_threshold": 0.2, "verbose": false, "when": "training"}, "cost": "{\\\\"kind\\\\": \\\\"quadratic\\\\"}", "routing": 10}')
    plan_default = torch.ops.vitbal.plan.default(getitem_10, getitem_11, 2, '{"bands": {"align": 4, "compiled": true, "exchange_layers": 1, "heads": 4, "kv_bytes_per_patch": 128, "min_patches": 1024}, "config": {"band_exchange": "auto", "cost_coeffs": null, "cost_model": "quadratic", "enabled": true, "max_iters": 20, "max_len_ratio": null, "memory_budget": null, "min_band_patches": 1024, "min_gain": 0.02, "skip_rule": "no-gain", "split_frames": true, "split_images": true, "strategy": "min-move", "tolerance": 0.05, "trigger_threshold": 0.2, "verbose": false, "when": "training"}, "cost": "{\\\\"kind\\\\": \\\\"quadratic\\\\"}", "routing": 10}', 2, '0', in_balancing_mode, layout_token, getitem_12, False, None, runs_bands);  in_balancing_mode = layout_token = getitem_12 = None
    getitem_13 = plan_default[0]
    getitem_14 = plan_default[1];  plan_default = None
    redistribute_default = torch.ops.vitbal.redistribute.default([getitem_10], getitem_14, 4, [4], None, '0')
    getitem_15 = redistribute_default[0];  redistribute_default = None
    bands_for_vit = fx_vitbal_runtime_bands_view_bands_for_vit(getitem_14, getitem_13, '0', runs_bands);  runs_bands = None
    visual = self.visual(getitem_15, getitem_13, vitbal_bands = bands_for_vit);  getitem_13 = bands_for_vit = None
    getitem_16 = visual[0];  visual = None
    size = getitem_15.size(0);  getitem_15 = None
    output_block_rows = fx_vitbal_runtime_transport_ops_output_block_rows([getitem_16], size, 4);  size = None
    size_1 = getitem_10.size(0);  getitem_10 = None
    home_rows = fx_vitbal_runtime_transport_ops_home_rows(output_block_rows, size_1, 4);  size_1 = None
    no_backward_will_come = fx_vitbal_runtime_transport_ops_no_backward_will_come([getitem_16])
    restore_default = torch.ops.vitbal.restore.default([getitem_16], getitem_14, 4, output_block_rows, home_rows, '0', True, no_backward_will_come);  getitem_16 = output_block_rows = home_rows = no_backward_will_come = None
    getitem_17 = restore_default[0];  restore_default = None
    visual_2 = self.visual""",
        )

    def test_replica_sets_ride_in_the_plan_node_only(self):
        gm = symbolic_trace(_model())
        apply_vit_balance_pass(gm, config=QUADRATIC, replica_group=[1, 0], **FIXED)
        plan = next(n for n in gm.graph.nodes if n.target is torch.ops.vitbal.plan.default)
        self.assertExpectedInline(
            f"{plan.args[4:]} {plan.kwargs}",
            """(2, '0', in_balancing_mode, layout_token, getitem_10, False, [0, 1], runs_bands) {}""",
        )
        self.assertEqual(gm.code.count("[0, 1]"), 1)  # in the plan node, and nowhere else

    def test_pass_is_idempotent(self):
        gm = apply_vit_balance_pass(symbolic_trace(_model(deepstack_indexes=(0, 1))), **FIXED)
        code = gm.code
        self.assertIs(apply_vit_balance_pass(gm, **FIXED), gm)
        self.assertEqual(gm.code, code)
        self.assertEqual(code.count("vitbal.plan.default("), 1)

    def test_without_a_process_group_the_pass_is_a_no_op(self):
        gm = symbolic_trace(_model())
        code = gm.code
        apply_vit_balance_pass(gm)
        self.assertEqual(gm.code, code)

    def test_a_vit_output_used_whole_is_refused(self):
        gm = symbolic_trace(_model())
        vit = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "visual")
        with gm.graph.inserting_after(vit):
            gm.graph.call_function(operator.length_hint, (vit,))
        with self.assertRaisesRegex(ValueError, r"vis\[0\], vis\[1\] and vis\[2\]\[k\]"):
            apply_vit_balance_pass(gm, **FIXED)


STEPS = [  # per step, per rank: a skewed batch; rank 0 has no image in the last step
    [[[1, 8, 8], [2, 4, 6]], [[1, 2, 2]]],
    [[], [[1, 12, 8], [1, 2, 4], [1, 2, 2]]],
]


def _pass_vs_reference(rank: int, world: int, compiled: bool) -> list:
    config = dict(deepstack_indexes=(0,))
    reference = _model(**config)
    wanted = [train_step(reference, step[rank], rank) for step in STEPS]
    gm = apply_vit_balance_pass(symbolic_trace(_model(**config)))
    run = torch.compile(gm, backend="aot_eager", fullgraph=True) if compiled else gm
    with record_moves() as moves, fullgraph_capture(compiled):
        got = [train_step(run, step[rank], rank) for step in STEPS]
    return {"got": got, "wanted": wanted, "moves": moves}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager_fullgraph"])
def test_rewritten_graph_matches_unbalanced_model_on_two_ranks(compiled):
    results = run_ranks(_pass_vs_reference, 2, compiled)
    for res in results:
        for (logits, grads), (want_logits, want_grads) in zip(
            *(res[k] for k in ("got", "wanted")), strict=True
        ):
            torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grads, want_grads, rtol=1e-5, atol=1e-6)
    assert_units_moved(results)
