"""The timeline PNG a run leaves: stages named, units on the axes, ops explained, nothing cut off,
and the median step drawn (not the last). No processes: measurements are written by hand."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from ldt.schedule.timeline import draw, median_step, result_from_measurements, to_png

# Two stages of a U-shape-like step, in seconds from each stage's step start.
EDGE = [("0FS0", 0.000, 0.004), ("0SEND_F0>1", 0.004, 0.0041), ("0FE0", 0.020, 0.026),
        ("0BS0", 0.026, 0.030), ("0BE0", 0.050, 0.061)]
CLOUD = [("1F0", 0.005, 0.015), ("1B0", 0.031, 0.049)]


def measured():
    return result_from_measurements([EDGE, CLOUD], [0.0, 0.0])


def test_draw_names_stages_units_and_every_op():
    fig = draw(measured(), "measured step 3", stage_names=["edge", "cloud0"])
    try:
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 1: cloud0", "stage 0: edge"]
        assert ax.get_xlabel() == "time (ms)" and ax.get_ylabel() == "pipeline stage"
        assert "iteration 61 ms" in ax.get_title()
        assert ax.get_xlim()[1] > 61.0  # the last box (0BE0 ends at 61 ms) is not cut
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        for op in ("F", "B", "FS", "FE", "BS", "BE"):
            assert any(t.startswith(f"{op}: ") for t in legend), (op, legend)
        assert "micro-batch" in fig.legends[0].get_title().get_text()
    finally:
        plt.close(fig)


def test_unit_costs_are_labelled_as_such():
    result = result_from_measurements([[("0F0", 0, 3), ("0B0", 3, 9)]])
    fig = draw(result, "unit costs", time_unit=None)
    try:
        assert fig.axes[0].get_xlabel() == "time (cost-model units)"
        assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["stage 0"]
    finally:
        plt.close(fig)


def test_png_keeps_everything_inside_the_image(tmp_path):
    """Every label is inside the saved image: its outer border is background only."""
    path = tmp_path / "t.png"
    to_png(measured(), path, "a title long enough to reach far to the right " * 2,
           stage_names=["a stage with a long name", "cloud0"])
    image = plt.imread(path)[..., :3]
    border = np.concatenate([image[:3].reshape(-1, 3), image[-3:].reshape(-1, 3),
                             image[:, :3].reshape(-1, 3), image[:, -3:].reshape(-1, 3)])
    assert (border > 0.99).all()
    assert image.min() < 0.2  # something was drawn


@pytest.mark.parametrize("one_clock", [True, False])
def test_median_step_is_drawn(one_clock):
    # step spans (stage 1 ends last): 0 -> 9 (warm-up), 1 -> 2, 2 -> 5, 3 -> 4, 4 -> 3
    ends = [9.0, 2.0, 5.0, 4.0, 3.0]
    per_stage = [[(10.0 * i, [("0F0", 0.0, 1.0)]) for i in range(5)],
                 [(10.0 * i, [("1F0", 0.0, e)]) for i, e in enumerate(ends)]]
    assert median_step(per_stage, one_clock) == 3  # span 4, the median of the five
    # stage 0 starts step 1 at 2.0 instead of 10.0: on one clock that step now spans
    # 2.0 .. 12.0 = 10 (spans 9, 10, 5, 4, 3: median 5, step 2); clocks that do not compare
    # see each stage's own span only, so nothing changes
    per_stage[0][1] = (2.0, per_stage[0][1][1])
    assert median_step(per_stage, one_clock) == (2 if one_clock else 3)
