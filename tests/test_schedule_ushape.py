"""The U-shape schedule's promises, checked with the simulator (see docs/ushape_schedule.md).

Costs are exact (Fractions), so every comparison is exact. "Cloud" = stages 1..P-1 with F = 1,
B = r; "edge" = stage 0 whose chunks cost ``edge_share`` of the cloud's (FS, FE cost edge_share,
BS, BE cost edge_share * r). The yardstick is the (P+1)-stage 1F1B in which the edge's two chunks
sit on two devices of their own (logical stages 0 and P with the edge's costs): the U-shape runs
them on one device, so matching that pipeline means the shared edge costs nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache

import pytest

from ldt.schedule import Action, Op, check_schedule, forwards_of, lower, one_f_one_b, simulate, u_shape

RATIOS = [Fraction(1), Fraction(2)]


@lru_cache(maxsize=None)
def lowered(p: int, m: int, r: Fraction, kind: str) -> dict[int, list[Action]]:
    """Lowered schedules are read-only here; build each once."""
    if kind == "ushape":
        return lower(u_shape(p, m, backward_ratio=r), "ushape")
    return lower(one_f_one_b(p + 1, m), "1f1b")


def costs(p: int, r: Fraction, edge_share: Fraction) -> tuple[Callable[[Action], Fraction],
                                                             Callable[[Action], Fraction]]:
    """(duration for the U-shape, duration for the two-device (P+1)-stage 1F1B yardstick)."""
    ef, eb = edge_share, edge_share * r

    def ushape(a: Action) -> Fraction:
        return {Op.F: Fraction(1), Op.B: r, Op.FS: ef, Op.FE: ef, Op.BS: eb, Op.BE: eb}[a.op]

    def yardstick(a: Action) -> Fraction:
        forward = a.op is Op.F
        if a.stage in (0, p):
            return ef if forward else eb
        return Fraction(1) if forward else r

    return ushape, yardstick


def iteration(p: int, m: int, r: Fraction, edge_share: Fraction, latency: Fraction = Fraction(0)
              ) -> tuple[Fraction, Fraction]:
    ushape_cost, yardstick_cost = costs(p, r, edge_share)
    comm = lambda a: latency  # noqa: E731
    u = simulate(lowered(p, m, r, "ushape"), ushape_cost, comm)
    y = simulate(lowered(p, m, r, "1f1b"), yardstick_cost, comm)
    return u.iteration_time, y.iteration_time


@pytest.mark.parametrize("r", RATIOS)
def test_edge_runs_fs_fe_bs_be_per_microbatch(r: Fraction) -> None:
    for p in range(2, 9):
        for m in range(1, 3 * p + 1):
            edge = u_shape(p, m, backward_ratio=r)[0]
            position = {(a.op, a.mb): i for i, a in enumerate(edge)}
            for mb in range(m):
                fs, fe, bs, be = (position[(op, mb)] for op in (Op.FS, Op.FE, Op.BS, Op.BE))
                assert fs < fe < bs < be, f"P={p} m={m} micro-batch {mb}"
                assert bs == fe + 1, "the loss's backward (BS) must follow its forward (FE) at once"


@pytest.mark.parametrize("r", RATIOS)
def test_edge_order_counts(r: Fraction) -> None:
    """Warmup FS x min(P+1, m), then (FE, BS) x min(m, floor((1 + P r) / (1 + r)) + 1), then BE."""
    for p in range(2, 9):
        for m in range(1, 2 * p + 3):
            ops = [a.op for a in u_shape(p, m, backward_ratio=r)[0]]
            warmup = min(p + 1, m)
            pairs = min(m, (1 + p * r) // (1 + r) + 1)
            assert ops[:warmup] == [Op.FS] * warmup
            assert ops[warmup:warmup + 2 * pairs] == [Op.FE, Op.BS] * pairs
            assert ops[warmup + 2 * pairs] is Op.BE
            tail = min(m, pairs)  # cooldown: the last BEs, nothing else left to run
            assert ops[-tail:] == [Op.BE] * tail


@pytest.mark.parametrize("r", RATIOS)
def test_edge_memory_matches_1f1b_first_stage(r: Fraction) -> None:
    for p in range(2, 9):
        for m in range(1, 3 * p + 1):
            result = simulate(lower(u_shape(p, m, backward_ratio=r), "ushape"), lambda a: 1)
            assert result.peak_inflight[0] == min(p + 1, m)  # start chunk: FS .. BE
            assert result.peak_inflight_end[0] == 1  # end chunk: FE .. BS, back to back
            for s in range(1, p):
                assert result.peak_inflight[s] == min(p - s + 1, m)


@pytest.mark.parametrize("r", RATIOS)
@pytest.mark.parametrize("edge_share", [Fraction(1, 2), Fraction(1, 4), Fraction(1, 10)])
def test_shared_edge_costs_nothing_extra(r: Fraction, edge_share: Fraction) -> None:
    """Edge chunks at <= half a cloud stage's cost, zero comm: the U-shape's iteration time equals
    the (P+1)-stage 1F1B that gives each edge chunk its own device -- for every m, fill and drain
    included. That pipeline is in turn no slower than (m + P) (1 + r), the uniform (P+1)-stage 1F1B."""
    for p in range(2, 9):
        for m in range(1, 2 * p + 3):
            ushape_time, yardstick_time = iteration(p, m, r, edge_share)
            assert ushape_time == yardstick_time, f"P={p} m={m}"
            assert ushape_time <= (m + p) * (1 + r)


@pytest.mark.parametrize("r", RATIOS)
@pytest.mark.parametrize("edge_share", [Fraction(1, 2), Fraction(1, 10)])
def test_no_steady_state_bubble(r: Fraction, edge_share: Fraction) -> None:
    """Once the pipeline is full (m >= P + 2), each extra micro-batch adds exactly one cloud F + B
    to the iteration: the cloud stages never idle in steady state, however large m grows."""
    for p in range(2, 9):
        times = [iteration(p, m, r, edge_share)[0] for m in range(p + 2, 2 * p + 6)]
        assert {b - a for a, b in zip(times, times[1:])} == {1 + r}, f"P={p}"


@pytest.mark.parametrize("r", RATIOS)
def test_latency_below_edge_forward_adds_no_bubble(r: Fraction) -> None:
    """With slack on the edge (chunks at 1/4 of a cloud stage) and a link latency up to the edge's
    forward time, the U-shape still equals the two-device yardstick under the same latency."""
    edge_share = Fraction(1, 4)
    for latency in (edge_share / 2, edge_share):
        for p in range(2, 8):
            for m in range(1, 2 * p + 3):
                ushape_time, yardstick_time = iteration(p, m, r, edge_share, latency)
                assert ushape_time == yardstick_time, f"P={p} m={m} latency={latency}"


def test_edge_as_slow_as_cloud_is_edge_bound() -> None:
    """An edge as slow as a cloud stage does 2x a cloud stage's work per micro-batch: it becomes
    the bottleneck, and the simulator shows it (iteration >= the edge's total work)."""
    for p in range(2, 7):
        m = 3 * p
        ushape_time, _ = iteration(p, m, Fraction(1), Fraction(1))
        assert ushape_time >= 4 * m


@pytest.mark.parametrize("kind", ["ushape", "1f1b"])
def test_forward_only_schedules_are_deadlock_free_and_complete(kind: str) -> None:
    """Evaluation runs the training schedule's forwards: every micro-batch's forward on every
    stage, no backward, no gradient message, and no wait cycle (checked by play)."""
    forwards = {Op.F, Op.FS, Op.FE}
    for p in range(2, 9):
        for m in range(1, 3 * p + 1):
            train = (u_shape if kind == "ushape" else one_f_one_b)(p, m)
            schedule = lower(forwards_of(train), kind)
            check_schedule(schedule)
            for s, actions in schedule.items():
                compute = [a for a in actions if a.is_compute]
                assert {a.op for a in compute} <= forwards
                assert sorted((a.op.value, a.mb) for a in compute) == sorted(
                    (a.op.value, a.mb) for a in train[s] if a.op in forwards)
                assert all(a.op.value[-1] != "B" for a in actions if not a.is_compute), (p, m)


# ---- prefetch: tolerance of edge <-> cloud link latency (docs/network.md) --------------------
PREFETCH = [1, 2, 3]


def prefetching(p: int, m: int, d: int, r: Fraction = Fraction(2)) -> dict[int, list[Action]]:
    return lower(u_shape(p, m, backward_ratio=r, prefetch=d), "ushape", prefetch=d)


def edge_link_time(p: int, m: int, r: Fraction, edge_share: Fraction, latency: Fraction,
                   d: int) -> Fraction:
    """Iteration time with ``latency`` on the edge's links only (stage 0 <-> 1 and P-1)."""
    ushape_cost, _ = costs(p, r, edge_share)
    return simulate(prefetching(p, m, d, r), ushape_cost,
                    lambda a: latency if 0 in (a.stage, a.peer) else 0).iteration_time


@pytest.mark.parametrize("d", PREFETCH)
def test_prefetch_is_deadlock_free_and_holds_the_stated_memory(d: int) -> None:
    """Every P = 2..8, m = 1..3P: complete, deadlock-free (training and evaluation), the edge's
    start chunk holds min(P + 1 + 2d, m) micro-batches, cloud stage s min(P + 1 - s + d, m), the
    end chunk one; receives on the edge's links are posted up to 1 + 2d ahead."""
    for p in range(2, 9):
        for m in range(1, 3 * p + 1):
            schedule = prefetching(p, m, d)
            result = simulate(schedule, lambda a: 1)  # checks structure, plays for deadlock
            assert result.peak_inflight[0] == min(p + 1 + 2 * d, m), (p, m)
            assert result.peak_inflight_end[0] == 1
            for s in range(1, p):
                assert result.peak_inflight[s] == min(p + 1 - s + d, m), (p, m, s)
            check_schedule(lower(forwards_of(u_shape(p, m, prefetch=d)), "ushape", prefetch=d))
            posted = outstanding = 0
            for a in schedule[1]:
                if a.channel == (0, 1, "F"):
                    outstanding += {Op.RECV_F: 1, Op.WAIT_F: -1}[a.op]
                    posted = max(posted, outstanding)
            assert posted == min(1 + 2 * d, m), (p, m)


@pytest.mark.parametrize("r", RATIOS)
@pytest.mark.parametrize("edge_share", [Fraction(1, 4), Fraction(1, 3), Fraction(1, 2)])
def test_prefetch_hides_edge_link_latency(r: Fraction, edge_share: Fraction) -> None:
    """A one-way latency of up to 2 edge forwards (d = 1) or 4 (d = 2) on the edge's links adds no
    steady-state bubble (each extra micro-batch adds exactly one cloud F + B), and the whole
    iteration pays only the fill and drain: at most the 4 slow crossings of one micro-batch's
    round trip (FS -> cloud, cloud -> FE, BS -> cloud, cloud -> BE) over no latency at all."""
    for d, most in ((1, 2), (2, 4)):
        for p in range(2, 7):
            for k in range(1, most + 1):
                latency = k * edge_share  # k edge forwards
                first = p + 2 + 2 * d
                times = [edge_link_time(p, m, r, edge_share, latency, d)
                         for m in range(first, first + 3)]
                assert {b - a for a, b in zip(times, times[1:])} == {1 + r}, (d, p, k)
                m = 4 * p
                assert (edge_link_time(p, m, r, edge_share, latency, d)
                        <= edge_link_time(p, m, r, edge_share, Fraction(0), 0) + 4 * latency)


def test_without_prefetch_two_edge_forwards_of_latency_cost_a_bubble() -> None:
    """The plain U-shape (d = 0) hides latency only below about one edge forward: at 2 it pays
    in steady state (edge share 1/2, B = 2F), which is what prefetch removes."""
    r, share, latency = Fraction(2), Fraction(1, 2), Fraction(1)  # 2 edge forwards
    for p in (2, 3, 4):
        for d, bubble in ((0, True), (1, False)):
            first = 6 * p
            times = [edge_link_time(p, m, r, share, latency, d) for m in (first, first + 4)]
            assert ((times[1] - times[0]) / 4 > 1 + r) == bubble, (p, d)
