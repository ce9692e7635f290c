"""Tests for ldt.config.layout: Megatron's layout grammar, the per-stage split and the U-shape rule."""

import pathlib
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ldt.config.layout import Chunk, LayerSplit, LayoutError, is_uniform, parse_layout, split_layers

E, t, m, L = "E", "t", "m", "L"
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- grammar examples

@pytest.mark.parametrize("text, expected", [
    ("E|(tt|)*3L", [[E], [t, t], [t, t], [t, t], [L]]),
    ("Ettt|(tt|)*29,m|L", [[E, t, t, t]] + [[t, t]] * 29 + [[m], [L]]),
    ("Et*3|(t|)*2,tL", [[E, t, t, t], [t], [t], [t, L]]),
    ("E||tL", [[E], [], [t, L]]),
    ("E|(t|)*2|*2L", [[E], [t], [t], [], [], [L]]),
    ("E, t*2 |\n t t ,L", [[E, t, t], [t, t, L]]),
    ("E|((t|)*2t|)*2L", [[E], [t], [t], [t], [t], [t], [t], [L]]),
    ("E(t(t)*2)L", [[E, t, t, t, L]]),
    ("Et*12L", [[E] + [t] * 12 + [L]]),
    ("Et*0|tL", [[E], [t, L]]),
    ("", [[]]),
    ("|", [[], []]),
])
def test_parse_examples(text, expected):
    assert parse_layout(text) == expected


def test_megatron_doc_example_split():
    # DeepSeek-V3-like: 61 layers, PP=16, VPP=2, MTP on stage 14's second chunk, loss alone at the end.
    s = split_layers(61, 16, layout="Ettt|(tt|)*29,m|L")
    assert s.vpp_size == 2 and len(s.chunks) == 16
    assert s.describe(0) == "E,0-2 | 33-34"
    assert s.describe(1) == "3-4 | 35-36"
    assert s.describe(14) == "29-30 | m"
    assert s.describe(15) == "31-32 | L"
    c15 = s.stage_chunks(15)
    assert [c.segment for c in c15] == [15, 31]
    assert c15[1].has_head and c15[1].num_layers == 0 and s.chunks[14][1].num_mtp == 1
    assert s.to_layout_string().startswith("Et*3|t*2|")
    assert split_layers(61, 16, layout=s.to_layout_string()) == s


def test_u_shape_edge_and_cloud():
    s = split_layers(8, 3, u_shape=True, layout="Et*2|t*2|t*2|t*2L")
    assert [s.describe(i) for i in range(3)] == ["E,0-1 | 6-7,L", "2-3", "4-5"]
    start, end = s.stage_chunks(0)
    assert (start.index, start.segment, end.index, end.segment) == (0, 0, 1, 3)
    assert end.layers == range(6, 8) and end.has_head and start.has_embedding
    assert s.vpp_size == 1 and not is_uniform(s)
    empty = split_layers(1, 2, u_shape=True, layout="E|t|L")
    assert [empty.describe(i) for i in range(2)] == ["E | L", "0"]


def test_even_split_examples():
    plain = split_layers(10, 4)
    assert [plain.stage_num_layers(i) for i in range(4)] == [3, 3, 2, 2]
    assert plain.to_layout_string() == "Et*3|t*3|t*2|t*2L"
    assert is_uniform(split_layers(8, 4)) and not is_uniform(plain)
    u = split_layers(10, 3, u_shape=True)  # 4 segments: base 2, remainder 2 -> both cloud stages
    assert u.to_layout_string() == "Et*2|t*3|t*3|t*2L"
    assert split_layers(2, 4, u_shape=True).to_layout_string() == "E|t|t||L"
    assert split_layers(3, 3, u_shape=True).to_layout_string() == "Et|t|t|L"
    assert split_layers(0, 2).to_layout_string() == "E|L"
    assert split_layers(5, 2, layout="  ") == split_layers(5, 2)  # blank layout = omitted


def test_module_imports_neither_torch_nor_megatron():
    path = pathlib.Path(__file__).resolve().parents[1] / "ldt" / "config" / "layout.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ldt_layout_probe', {str(path)!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'heavy import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- validation errors

@pytest.mark.parametrize("text, needles", [
    ("E|tt?L", ["cluster.layout", "'E|tt?L'", "'?'", "position 4", "    ^", "fix:"]),
    ("E|(tt|L", ["unclosed '('", "position 2"]),
    ("E|tt)L", ["unmatched ')'", "position 4"]),
    ("E|T*2L", ["'T'", "did you mean 't'"]),
    ("t*2*3", ["'*'", "position 3"]),
    ("t*", ["repeat count"]),
    ("t3", ["number 3", "t*3"]),
    ("E()|L", ["empty group"]),
    ("E|t)", ["unmatched"]),
    ("((t*1000)*1000)*1000", ["more than"]),
])
def test_grammar_errors(text, needles):
    with pytest.raises(LayoutError) as err:
        parse_layout(text)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_caret_points_at_offending_character():
    with pytest.raises(LayoutError) as err:
        parse_layout("Et|t x|tL")
    lines = str(err.value).splitlines()
    shown, caret = lines[1], lines[2]
    assert shown[caret.index("^")] == "x"


@pytest.mark.parametrize("args, layout, needles", [
    ((4, 2), "Et|ttL", ["cluster.layout", "'Et|ttL'", "3", "model.num_layers is 4"]),
    ((3, 2), "t|ttL", ["no 'E'", "first token of the first segment"]),
    ((3, 2), "Et|EttL", ["'E'", "2 times", "position 3"]),
    ((3, 2), "tE|ttL", ["'E'", "must be the first token", "position 1"]),
    ((3, 2), "Et|tt", ["no 'L'"]),
    ((3, 2), "ELt|ttL", ["'L'", "2 times"]),
    ((3, 2), "Et|tLt", ["'L'", "must be the last token", "position 4"]),
    ((3, 3), "Et|ttL", ["3 stages need a multiple of 3 segments", "got 2"]),
    ((3, 2), "Et|mttL", ["'m'", "after every decoder layer", "position 3"]),
])
def test_split_validation_errors(args, layout, needles):
    with pytest.raises(LayoutError) as err:
        split_layers(*args, layout=layout)
    msg = str(err.value)
    assert "fix:" in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_u_shape_segment_count_and_stage_errors():
    with pytest.raises(LayoutError, match=r"u_shape with 3 stages needs 4 segments \(the last runs on stage 0\), got 3"):
        split_layers(3, 3, u_shape=True, layout="Et|t|tL")
    with pytest.raises(LayoutError, match="cluster.u_shape") as err:
        split_layers(3, 1, u_shape=True)
    assert "got 1" in str(err.value)
    with pytest.raises(LayoutError, match="cluster.stages"):
        split_layers(3, 0)
    with pytest.raises(LayoutError, match="model.num_layers"):
        split_layers(-1, 2)


def test_mtp_allowed_after_decoder_layers():
    s = split_layers(2, 2, layout="Et|tm*2L")
    assert s.chunks[1][0].num_mtp == 2 and s.describe(1) == "1,m*2,L"
    assert s.to_layout_string() == "Et|tm*2L"


# ---------------------------------------------------------------- property tests

segments_st = st.lists(st.lists(st.sampled_from("EtmL"), max_size=6), min_size=1, max_size=8)


def render(draw, syms, depth, megatron_safe):
    """Render a flat symbol list (tokens and '|') with random compression and cosmetics."""
    out, i = [], 0
    seps = ["", "", ","] if megatron_safe else ["", "", ",", " ", ", "]
    while i < len(syms):
        kind = draw(st.sampled_from(["one", "run", "group", "bare"]))
        if kind == "run":
            run = 1
            while i + run < len(syms) and syms[i + run] == syms[i]:
                run += 1
            n = draw(st.integers(1, run))
            out.append(f"{syms[i]}*{n}")
            i += n
        elif kind in ("group", "bare") and depth < (1 if megatron_safe else 3):
            k = draw(st.integers(1, min(4, len(syms) - i)))
            body, reps = syms[i:i + k], 1
            while syms[i + reps * k:i + (reps + 1) * k] == body:
                reps += 1
            if kind == "bare" and not megatron_safe:
                out.append("(" + render(draw, body, depth + 1, megatron_safe) + ")")
                i += k
            else:
                n = draw(st.integers(1, reps))
                out.append("(" + render(draw, body, depth + 1, megatron_safe) + f")*{n}")
                i += k * n
        else:
            out.append(syms[i])
            i += 1
        out.append(draw(st.sampled_from(seps)))
    return "".join(out)


def flatten(segments):
    return list("|".join("".join(seg) for seg in segments))


@FAST
@given(segments=segments_st, data=st.data())
def test_roundtrip_render_parse(segments, data):
    text = render(data.draw, flatten(segments), 0, megatron_safe=False)
    assert parse_layout(text) == segments, text


MEGATRON_NAMES = {"embedding": E, "decoder": t, "mtp": m, "loss": L}


@pytest.fixture(scope="module")
def megatron_layout():
    mod = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    return mod.PipelineParallelLayerLayout


@FAST
@given(segments=segments_st, data=st.data())
def test_parse_agrees_with_megatron(megatron_layout, segments, data):
    text = render(data.draw, flatten(segments), 0, megatron_safe=True)
    theirs = [[MEGATRON_NAMES[x.name] for x in seg] for seg in megatron_layout.parse_str_to_list(text)]
    assert parse_layout(text) == theirs == segments, text


def check_split(s: LayerSplit, num_layers, P, u_shape):
    assert s.num_stages == P and s.u_shape == u_shape and s.num_layers == num_layers
    order = s.model_order
    assert [c.segment for c in order] == list(range(len(order)))
    assert [layer for c in order for layer in c.layers] == list(range(num_layers))
    for stage, chunks in enumerate(s.chunks):
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert all(c.stage == stage for c in chunks)
    assert [c for c in order if c.has_embedding] == [s.chunks[0][0]]
    head = s.chunks[0][1] if u_shape else s.chunks[P - 1][-1]
    assert [c for c in order if c.has_head] == [head] and order[-1] == head
    assert split_layers(num_layers, P, u_shape=u_shape, layout=s.to_layout_string()) == s


@FAST
@given(num_layers=st.integers(0, 200), P=st.integers(1, 16), u_shape=st.booleans())
def test_even_split_properties(num_layers, P, u_shape):
    if u_shape and P < 2:
        P = 2
    s = split_layers(num_layers, P, u_shape=u_shape)
    check_split(s, num_layers, P, u_shape)
    counts = [c.num_layers for c in s.model_order]
    assert max(counts) - min(counts) <= 1
    if u_shape:
        assert len(s.chunks[0]) == 2 and all(len(s.chunks[i]) == 1 for i in range(1, P))
        cloud = counts[1:P]
        if num_layers >= P - 1:
            assert min(cloud) >= 1
        assert counts[0] <= max(cloud) and counts[P] <= counts[0]  # the edge gets no more than the cloud
    else:
        assert s.vpp_size == 1 and counts == sorted(counts, reverse=True)


@FAST
@given(P=st.integers(1, 6), k=st.integers(1, 3), u_shape=st.booleans(), data=st.data())
def test_explicit_layout_properties(megatron_layout, P, k, u_shape, data):
    if u_shape:
        P, k = max(P, 2), 1
    nseg = P + 1 if u_shape else P * k
    counts = data.draw(st.lists(st.integers(0, 4), min_size=nseg, max_size=nseg))
    segments = [[t] * c for c in counts]
    segments[0].insert(0, E)
    segments[-1].append(L)
    text = render(data.draw, flatten(segments), 0, megatron_safe=True)
    s = split_layers(sum(counts), P, u_shape=u_shape, layout=text)
    check_split(s, sum(counts), P, u_shape)
    assert [c.num_layers for c in s.model_order] == counts
    if not u_shape:  # Megatron's own placement of segments on (pp rank, vpp rank)
        theirs = megatron_layout(text, P)
        assert theirs.virtual_pipeline_model_parallel_size == s.vpp_size == k
        for pp in range(P):
            for vpp in range(k):
                names = [MEGATRON_NAMES[x.name] for x in theirs.layout[pp][vpp]]
                assert names.count(t) == s.chunks[pp][vpp].num_layers
                assert (E in names, L in names) == (s.chunks[pp][vpp].has_embedding, s.chunks[pp][vpp].has_head)
        assert theirs.validate_layer_layout(sum(counts), None) is False


@FAST
@given(num_layers=st.integers(0, 40), P=st.integers(1, 6), extra=st.integers(1, 3))
def test_wrong_layer_count_names_both_numbers(num_layers, P, extra):
    text = split_layers(num_layers, P).to_layout_string()
    with pytest.raises(LayoutError) as err:
        split_layers(num_layers + extra, P, layout=text)
    msg = str(err.value)
    assert "cluster.layout" in msg and f"has {num_layers} decoder" in msg and f"is {num_layers + extra}" in msg


def test_chunk_is_frozen():
    c = Chunk(stage=0, index=0, segment=0, first_layer=0, num_layers=2, has_embedding=True, has_head=False)
    with pytest.raises(Exception):
        c.stage = 1  # type: ignore[misc]
    assert c.layers == range(0, 2)


@pytest.mark.parametrize("counts,stages,u_shape,text", [
    ((2, 3, 0, 1), 4, False, "Et*2|t*3||tL"),
    ((1, 4, 4, 2), 3, True, "Et|t*4|t*4|t*2L"),
    ((3, 3), 1, False, "Et*3|t*3L"),  # two chunks on one stage
    ((5,), 1, False, "Et*5L"),
])
def test_a_split_of_counts_writes_the_layout_that_parses_back_to_it(counts, stages, u_shape,
                                                                   text):
    """The planner's layer counts become a layout through the one writer
    (Chunk.to_layout_string), and split_layers places that layout exactly as the counts."""
    from ldt.config.layout import split_of_counts

    split = split_of_counts(counts, stages, u_shape)
    assert split.to_layout_string() == text
    assert split_layers(sum(counts), stages, u_shape=u_shape, layout=text) == split
