"""The layer split's bottleneck search (ldt.plan.split): the bound picked directly equals the
smallest candidate bound at which every layer fits, found here by scanning all of them."""

from hypothesis import given, settings, strategies as st

from ldt.plan.split import EPS, Unit, _first_bound, _fits, _pick_bound, _rows, best_counts


def _scan(units, num_layers):
    rows = _rows(units)
    bounds = sorted({u.overhead + k * u.per_layer for u in units
                     for k in range(u.lo, min(u.cap, num_layers) + 1)})
    return next((b for b in bounds if _fits(rows, b, num_layers)), None)


def _units(pers, nudges):
    return st.builds(
        lambda per, over, lo, cap, nudge: Unit(per * (1 + nudge * 1e-12), over, lo, max(lo, cap)),
        st.sampled_from(pers), st.sampled_from([0.0, 0.5, 2.0, 3.3]), st.integers(1, 2),
        st.integers(1, 12), st.sampled_from(nudges))


@settings(max_examples=300, deadline=None)
@given(st.lists(_units([1.0, 1.5, 2.0, 3.0, 0.7], [-2, -1, 0, 1, 2]), min_size=1, max_size=6),
       st.integers(2, 30))
def test_first_bound_is_the_smallest_that_fits(units, num_layers):
    if sum(u.lo for u in units) > num_layers:
        return
    assert _first_bound(_rows(units), num_layers) == _scan(units, num_layers)


@settings(max_examples=200, deadline=None)
@given(st.lists(_units([1.0, 1.5, 2.0, 3.0], [0]), min_size=1, max_size=6), st.integers(2, 30))
def test_the_direct_pick_needs_no_fallback_when_times_are_exact(units, num_layers):
    """Times whose equal values are equal floats: the one-by-one pick alone finds the bound
    (the bisection is only for rounding)."""
    if sum(u.lo for u in units) > num_layers:
        return
    assert _pick_bound(_rows(units), num_layers) == _scan(units, num_layers)


def test_rounding_falls_back_to_the_bisection():
    """Two units whose second layer costs 2.0 and 2.0 + 2e-12: within the EPS slack both fit at
    2.0, the one-by-one pick says 2.0 + 2e-12; the check sends it to the bisection."""
    units = [Unit(1.0, 0.0, 1, 3), Unit(1.0 + 1e-12, 0.0, 1, 3)]
    rows = _rows(units)
    assert 1e-12 < EPS and _pick_bound(rows, 4) == 2 * (1.0 + 1e-12)
    assert _first_bound(rows, 4) == _scan(units, 4) == 2.0


def test_best_counts_balances_and_respects_caps():
    units = [Unit(1.0, 0.0, 1, 10), Unit(2.0, 0.0, 1, 10), Unit(1.0, 0.0, 1, 2)]
    assert best_counts(units, 10, m=8) == [6, 2, 2]  # bottleneck 6 = 6 x 1.0 = 3 x 2.0 - 0
    assert best_counts([Unit(1.0, 0.0, 1, 2)] * 2, 5, m=8) is None  # caps hold 4 layers
