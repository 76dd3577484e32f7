"""The four moves of a step with replica sets (``runtime.transport.moves``), on random sets and
plans, each rank's ``all_to_all`` simulated in one process: pixels reach the computing ranks,
outputs every rank of their set in place, output gradients come back summed over the set, pixel
gradients go to one rank of the set each. Without sets, the moves are the exchange's of old."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan.replicas import solve_for_sets
from fx_vitbal.plan.units import Plan
from fx_vitbal.runtime.agree.replicas import routing_for_sets
from fx_vitbal.runtime.transport.exchange import _cat_rows, _home_order, _summed
from fx_vitbal.runtime.transport.moves import move_of
from fx_vitbal.runtime.transport.routing import Routing, local_routing


def _simulate(routings, xs, outputs: bool, reverse: bool) -> list[torch.Tensor]:
    """Every rank's result of one exchange of ``xs`` (one tensor per rank, one column)."""
    world = len(routings)
    moves = [move_of(route, 1, outputs, reverse) for route in routings]
    sent = []
    for move, x in zip(moves, xs, strict=True):
        flat = _cat_rows(x, move.send) if move.send is not None else x
        assert flat.shape[0] == sum(move.in_splits)
        sent.append(flat.split(move.in_splits))
    results = []
    for d, move in enumerate(moves):
        chunks = [sent[s][d] for s in range(world)]
        assert [c.shape[0] for c in chunks] == move.out_splits
        if move.home is None:
            results.append(torch.cat(chunks))
        else:
            results.append(_home_order(_summed(chunks, move.sums), move.home, [1])[0])
    return results


@st.composite
def _replica_steps(draw):
    num_sets, replicas = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    world = num_sets * replicas
    ranks = draw(st.permutations(range(world)))  # sets of any ranks, not only contiguous ones
    sets = sorted(sorted(ranks[s * replicas : (s + 1) * replicas]) for s in range(num_sets))
    units = [
        draw(
            st.lists(st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3)), max_size=5)
        )
        for _ in sets
    ]
    costs = [[float(t * h * w) ** 1.5 for t, h, w in set_units] for set_units in units]
    config = BalanceConfig(
        strategy=draw(st.sampled_from(["min-move", "lpt"])), trigger_threshold=0.0, min_gain=0.0
    )
    return sets, units, costs, config


@given(_replica_steps())
@settings(max_examples=150, deadline=None)
def test_pixels_out_outputs_to_every_replica_gradients_summed_and_pixel_gradients_home(step):
    sets, units, costs, config = step
    world = sum(map(len, sets))
    rows = [[t * h * w for t, h, w in set_units] for set_units in units]
    plan, held = solve_for_sets(costs, rows, sets, config=config)
    set_of = {r: s for s, ranks in enumerate(sets) for r in ranks}
    routed = [routing_for_sets(plan, held, sets, units, r, 1) for r in range(world)]
    routings = [route for route, _ in routed]
    for route in routings:  # packed and parsed back whole (a routing tensor is padded)
        assert Routing.from_tensor(route.to_tensor(len(route.unit_rows) + 2)) == route
    # Each set's pixel rows: distinct values, so a row in the wrong place shows.
    pixels = [torch.arange(sum(r), dtype=torch.float64).view(-1, 1) + 1000 * s
              for s, r in enumerate(rows)]  # fmt: skip
    starts = [[0, *torch.tensor(r, dtype=torch.long).cumsum(0).tolist()] for r in rows]

    # Pixels out: each rank gets the rows of the units its grid lists (the dummy unit aside).
    arrived = _simulate(routings, [pixels[set_of[r]] for r in range(world)], False, False)
    computed_units = []
    for r, (route, arrivals) in enumerate(routed):
        assert arrived[r].shape[0] == sum(route.recv_rows)
        if not sum(route.recv_rows):
            continue
        grid = [units[s][i] for s, i in arrivals]  # the (set, index) of each unit computed here
        assert sum(t * h * w for t, h, w in grid) == arrived[r].shape[0]
        computed_units.append(arrived[r])
    # Each unit once in the group: the rows computed are each set's rows, once.
    computed = [v for a in computed_units for v in a.flatten().tolist()]
    assert sorted(computed) == sorted(torch.cat(pixels).flatten().tolist())

    # Outputs home: every rank of a set gets f(its set's pixels), in place.
    outputs = _simulate(routings, [2 * a + 1 for a in arrived], True, True)
    for r in range(world):
        torch.testing.assert_close(outputs[r], 2 * pixels[set_of[r]] + 1, rtol=0, atol=0)

    # Output gradients: each rank its own; the computing rank gets their sum over the set.
    grads = [torch.full_like(pixels[set_of[r]], 1.0) * (r + 1) + pixels[set_of[r]]
             for r in range(world)]  # fmt: skip
    summed = _simulate(routings, grads, True, False)
    want_sum = [sum(grads[r] for r in ranks) for ranks in sets]
    for r in range(world):
        # What rank r computes, from the arrived pixels' values (set s's rows are 1000*s + i).
        ids = arrived[r].flatten().long()
        want = (
            torch.stack([want_sum[int(v) // 1000][int(v) % 1000] for v in ids])
            if len(ids)
            else summed[r]
        )
        torch.testing.assert_close(summed[r], want.view(-1, 1), rtol=0, atol=0)

    # Pixel gradients home: to one rank of the set per unit; summed over the set, each unit's.
    back = _simulate(routings, summed, False, True)
    for s, ranks in enumerate(sets):
        torch.testing.assert_close(sum(back[r] for r in ranks), want_sum[s], rtol=0, atol=0)
        for r in ranks:  # a unit's rows are whole on one rank, zeros on the others
            route = routings[r]
            for i, (a, b) in enumerate(zip(starts[s], starts[s][1:], strict=False)):
                if route.sender[i] != r:
                    assert not back[r][a:b].any()


def test_without_sets_the_moves_are_the_exchange_of_old():
    plan = Plan([[(0, 0), (1, 0)], [(0, 1)]], True, "applied", [3, 1], [2, 2], 0.5, 0.0, 1)
    units = [[(1, 1, 2), (1, 1, 1)], [(1, 1, 1)]]
    routings = [local_routing(plan, units, r) for r in range(2)]
    xs = [torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([[4.0]])]
    arrived = _simulate(routings, xs, False, False)
    assert [a.flatten().tolist() for a in arrived] == [[1.0, 2.0, 4.0], [3.0]]
    for outputs in (False, True):  # without sets, outputs move like pixels
        back = _simulate(routings, arrived, outputs, True)
        assert [b.flatten().tolist() for b in back] == [[1.0, 2.0, 3.0], [4.0]]
    assert not routings[0].replicated
    assert Routing.from_tensor(routings[0].to_tensor(3)) == routings[0]
