"""Pipeline layouts: Megatron's ``--pipeline-model-parallel-layout`` grammar and ldt's per-stage split.

Grammar (what ``cluster.layout`` accepts; a superset of what Megatron's own parser reads):

* tokens ``E`` (embedding), ``t`` (decoder layer), ``m`` (MTP layer), ``L`` (final norm + output
  head + loss); ``|`` separates segments (pipeline stages / virtual-pipeline chunks);
* ``x*n`` repeats the preceding token (``|*n`` works too), ``(group)*n`` repeats a group, which may
  contain ``|`` and other groups (``E|(tt|)*3L``, ``E|((t|)*2t|)*2L``); a group without ``*n`` counts
  once; ``*0`` is allowed and drops the item, as in Megatron; an empty group ``()`` is an error;
* commas and whitespace are cosmetic and ignored anywhere except inside a number;
* empty segments are legal in the grammar (``E||tL``), as in Megatron; ldt's training refuses
  chunks without a decoder layer (``split_layers(..., min_chunk_layers=1)``).

Anything else raises :class:`LayoutError` (a ``ValueError``) whose message names the field, quotes
the value, points at the offending position with a caret and says how to fix it.

Placement (:func:`split_layers`): a plain pipeline of P stages takes k*P segments (k = virtual
pipeline size) and segment i runs on stage ``i % P`` as its chunk ``i // P`` (Megatron's rule). A
U-shape (edge-cloud) pipeline takes exactly P+1 segments: segment i < P runs on stage i, segment P
runs on stage 0 as its end chunk (stage 0: chunk 0 = segment 0, chunk 1 = segment P).
This module imports neither torch nor megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["LayoutError", "Chunk", "LayerSplit", "parse_layout", "split_layers", "split_of_counts",
           "is_uniform"]

FIELD = "cluster.layout"
MAX_TOKENS = 1_000_000  # guard against '((t*1000)*1000)*1000'-style blow-ups
_SYMBOLS = "EtmL|"
_DIGITS = "0123456789"
_CASE_HINT = {"T": "t", "e": "E", "l": "L", "M": "m"}
_GRAMMAR_FIX = (
    "use the tokens E (embedding), t (decoder layer), m (MTP layer), L (final norm + head + loss), "
    "'|' between segments, 'x*n' or '(group)*n' to repeat; commas and spaces are ignored, "
    "e.g. 'Et*3|(tt|)*2,tL'"
)


class LayoutError(ValueError):
    """A layout, or a number it must agree with, that cannot work.

    The message names the config ``field``, quotes the ``value``, shows a caret under ``pos`` (a
    0-based index into the value) when there is one, and ends with a ``fix:`` line.
    """

    def __init__(self, problem: str, *, value=None, fix: str = "", field: str = FIELD, pos=None):
        self.problem, self.value, self.fix, self.field, self.pos = problem, value, fix, field, pos
        if pos is not None:
            problem += f" at position {pos}"
        lines = [f"{field} = {value!r}: {problem}" if value is not None else f"{field}: {problem}"]
        if pos is not None and isinstance(value, str):
            shown = "".join(" " if c.isspace() else c for c in value)
            lines += ["    " + shown, "    " + " " * pos + "^"]
        if fix:
            lines.append("  fix: " + fix)
        super().__init__("\n".join(lines))

    def one_line(self) -> str:
        """The message without the caret picture, for one-line refusals."""
        head = self.problem + (f" at position {self.pos}" if self.pos is not None else "")
        head = (f"{self.field} = {self.value!r}: {head}" if self.value is not None
                else f"{self.field}: {head}")
        return head + (f"; fix: {self.fix}" if self.fix else "")


def _tokenize(text: str) -> list[tuple[str, object, int]]:
    """(kind, value, position) triples; kind is a symbol, '(', ')', '*' or '#' (a number)."""
    toks, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace() or c == ",":
            i += 1
        elif c in _SYMBOLS or c in "()*":
            toks.append((c, c, i))
            i += 1
        elif c in _DIGITS:
            j = i
            while j < len(text) and text[j] in _DIGITS:
                j += 1
            toks.append(("#", int(text[i:j]) if j - i < 10 else MAX_TOKENS + 1, i))
            i = j
        else:
            hint = f" (did you mean {_CASE_HINT[c]!r}? tokens are case-sensitive)" if c in _CASE_HINT else ""
            raise LayoutError(f"unexpected character {c!r}{hint}",
                              value=text, pos=i, fix=_GRAMMAR_FIX)
    return toks


def _parse(text: str, starts: list | None = None) -> list[list[tuple[str, int]]]:
    """Segments of (token, position in ``text``) pairs; ``starts`` (if given) receives where
    each segment begins: 0 for the first, else the position of the '|' that opens it."""
    if not isinstance(text, str):
        raise LayoutError(f"must be a string, got {type(text).__name__}", value=text, fix=_GRAMMAR_FIX)

    def fail(problem, pos, fix=_GRAMMAR_FIX):
        raise LayoutError(problem, value=text, pos=pos, fix=fix)

    toks = _tokenize(text)
    stack: list[list[tuple[str, int]]] = [[]]  # one frame per open '('
    opens: list[int] = []
    k = 0
    while k < len(toks):
        kind, val, pos = toks[k]
        k += 1
        if kind == "(":
            stack.append([])
            opens.append(pos)
            continue
        if kind == ")":
            if not opens:
                fail("unmatched ')'", pos, "remove it or add the matching '(' before it")
            if toks[k - 2][0] == "(":
                fail("empty group '()'", pos, "remove the '()' or put tokens inside it")
            body, _ = stack.pop(), opens.pop()
        elif kind in _SYMBOLS:
            body = [(kind, pos)]
        elif kind == "*":
            fail("'*' does not follow a token or a ')'", pos,
                 "write 'x*n' or '(group)*n'; to repeat a repeat, wrap it: '(t*2)*3'")
        else:
            prev = toks[k - 2][0] if k >= 2 and toks[k - 2][0] in _SYMBOLS else "x"
            fail(f"number {val} without a '*' before it", pos, f"write '{prev}*{val}' to repeat a token")
        n = 1
        if k < len(toks) and toks[k][0] == "*":
            if k + 1 >= len(toks) or toks[k + 1][0] != "#":
                fail("'*' is not followed by a repeat count", toks[k][2], "write 'x*n' with n a number")
            n = toks[k + 1][1]
            k += 2
        if len(stack[-1]) + len(body) * n > MAX_TOKENS:
            fail(f"expands to more than {MAX_TOKENS} tokens", pos, "use smaller repeat counts")
        stack[-1].extend(body * n)
    if opens:
        fail("unclosed '('", opens[-1], "add the matching ')' (followed by '*n' to repeat the group)")
    segments: list[list[tuple[str, int]]] = [[]]
    opened = [0]
    for sym, pos in stack[0]:
        if sym == "|":
            segments.append([])
            opened.append(pos)
        else:
            segments[-1].append((sym, pos))
    if starts is not None:
        starts[:] = opened
    return segments


def parse_layout(text: str) -> list[list[str]]:
    """Parse a layout string into segments of single-letter tokens.

    >>> parse_layout("E|(tt|)*2L")
    [['E'], ['t', 't'], ['t', 't'], ['L']]
    """
    return [[sym for sym, _ in seg] for seg in _parse(text)]


@dataclass(frozen=True)
class Chunk:
    """One model chunk: a contiguous run of the model placed on one stage."""

    stage: int
    index: int  # position on its stage: VPP chunk index; U-shape stage 0: 0 = start, 1 = end chunk
    segment: int  # position in the layout (model order)
    first_layer: int  # 0-based global index of its first decoder layer
    num_layers: int
    has_embedding: bool
    has_head: bool  # final norm + output head + loss ('L')
    num_mtp: int = 0

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    def describe(self) -> str:
        parts = ["E"] if self.has_embedding else []
        if self.num_layers:
            last = self.first_layer + self.num_layers - 1
            parts.append(str(last) if self.num_layers == 1 else f"{self.first_layer}-{last}")
        if self.num_mtp:
            parts.append("m" if self.num_mtp == 1 else f"m*{self.num_mtp}")
        if self.has_head:
            parts.append("L")
        return ",".join(parts) or "-"

    def to_layout_string(self) -> str:
        """This chunk's segment of the layout string (``Et*3``): the one writer of the grammar."""
        parts = (("E", self.has_embedding), ("t", self.num_layers), ("m", self.num_mtp), ("L", self.has_head))
        return "".join(tok * n if n < 2 else f"{tok}*{n}" for tok, n in parts)


@dataclass(frozen=True)
class LayerSplit:
    """Which layers each pipeline stage holds; ``chunks[s]`` lists stage s's chunks in order."""

    num_stages: int
    u_shape: bool
    chunks: tuple[tuple[Chunk, ...], ...]
    num_layers: int

    def stage_chunks(self, stage: int) -> tuple[Chunk, ...]:
        return self.chunks[stage]

    def stage_num_layers(self, stage: int) -> int:
        return sum(c.num_layers for c in self.chunks[stage])

    @property
    def vpp_size(self) -> int:
        """Chunks per stage of a plain pipeline (Megatron's VPP size); 1 for a U-shape."""
        return 1 if self.u_shape else len(self.chunks[0])

    @property
    def model_order(self) -> tuple[Chunk, ...]:
        """All chunks in layout (model) order."""
        return tuple(sorted((c for cs in self.chunks for c in cs), key=lambda c: c.segment))

    def describe(self, stage: int) -> str:
        """Compact text for a rank-map table: 'E,0-1 | 6-7,L' (U-shape edge), '2-3', '-' (empty)."""
        return " | ".join(c.describe() for c in self.chunks[stage])

    def to_layout_string(self) -> str:
        """Canonical layout string; ``split_layers(..., layout=s)`` gives back an equal split."""
        return "|".join(c.to_layout_string() for c in self.model_order)


def is_uniform(split: LayerSplit) -> bool:
    """True when every stage has one chunk and the same number of decoder layers."""
    return (not split.u_shape and split.vpp_size == 1
            and len({split.stage_num_layers(s) for s in range(split.num_stages)}) == 1)


def _even_segments(num_layers: int, num_stages: int, u_shape: bool,
                   num_mtp: int = 0) -> list[list[str]]:
    """Default split: see :func:`split_layers`."""
    nseg = num_stages + 1 if u_shape else num_stages
    base, rem = divmod(num_layers, nseg)
    counts = [base] * nseg
    # plain: earlier stages take the remainder; U-shape: cloud segments 1..P-1 first, then the
    # edge's start segment (rem <= P, so the edge's end segment never gets an extra layer).
    order = list(range(1, num_stages)) + [0, num_stages] if u_shape else list(range(nseg))
    for i in order[:rem]:
        counts[i] += 1
    return [(["E"] if i == 0 else []) + ["t"] * c + (["m"] * num_mtp + ["L"] if i == nseg - 1
                                                      else []) for i, c in enumerate(counts)]


def _validate(segs, text: str, num_layers: int, num_stages: int, u_shape: bool,
              num_mtp: int | None = None) -> None:
    n, P = len(segs), num_stages
    if u_shape and n != P + 1:
        raise LayoutError(
            f"u_shape with {P} stages needs {P + 1} segments (the last runs on stage 0), got {n}",
            value=text, fix=f"write {P + 1} '|'-separated segments: the edge's start chunk, one per "
            f"cloud stage ({P - 1}), then the edge's end chunk; or change cluster.stages")
    if not u_shape and n % P:
        raise LayoutError(
            f"{P} stages need a multiple of {P} segments (one per stage, or k per stage for k "
            f"virtual-pipeline chunks), got {n}", value=text,
            fix=f"add or remove '|' to get {P} (or {2 * P}, {3 * P}, ...) segments, or change cluster.stages")
    flat = [(sym, pos, si, j) for si, seg in enumerate(segs) for j, (sym, pos) in enumerate(seg)]
    for tok, name, where, ok in (
        ("E", "embedding", "first token of the first segment", lambda si, j: si == 0 and j == 0),
        ("L", "final norm + head + loss", "last token of the last segment",
         lambda si, j: si == n - 1 and j == len(segs[-1]) - 1),
    ):
        hits = [f for f in flat if f[0] == tok]
        if not hits:
            raise LayoutError(f"no '{tok}' ({name}); it must be the {where}", value=text,
                              fix=f"add '{tok}' as the {where}")
        if len(hits) > 1:
            raise LayoutError(f"'{tok}' ({name}) appears {len(hits)} times; it must appear once",
                              value=text, pos=hits[1][1], fix=f"keep one '{tok}', as the {where}")
        if not ok(hits[0][2], hits[0][3]):
            raise LayoutError(f"'{tok}' ({name}) must be the {where}", value=text, pos=hits[0][1],
                              fix=f"move '{tok}' to be the {where}")
    count = sum(f[0] == "t" for f in flat)
    if count != num_layers:
        raise LayoutError(
            f"has {count} decoder layers ('t') but model.num_layers is {num_layers}", value=text,
            fix=f"use exactly {num_layers} 't' tokens, or change model.num_layers to {count}")
    last_t = max((i for i, f in enumerate(flat) if f[0] == "t"), default=-1)
    early = [f for i, f in enumerate(flat[:last_t]) if f[0] == "m"]
    if early:
        raise LayoutError("'m' (MTP layer) must come after every decoder layer 't'", value=text,
                          pos=early[0][1], fix="move the 'm' tokens after the last 't', before 'L'")
    mtp = sum(f[0] == "m" for f in flat)
    if num_mtp is not None and mtp != num_mtp:
        raise LayoutError(
            f"has {mtp} MTP layers ('m') but model.mtp_num_layers is {num_mtp}", value=text,
            fix=f"use exactly {num_mtp} 'm' tokens (before 'L'), or set model.mtp_num_layers={mtp}")


def _check_chunk_layers(segs, starts, layout, num_layers, num_stages, u_shape, minimum) -> None:
    """Refuse a segment with fewer than ``minimum`` decoder layers (see :func:`split_layers`)."""
    thin = [i for i, seg in enumerate(segs) if seg.count("t") < minimum]
    if not thin:
        return
    i = thin[0]
    shown = "".join(segs[i]) or "empty"
    if starts:  # an explicit layout: point at the segment
        raise LayoutError(
            f"segment {i} ({shown}) has {segs[i].count('t')} decoder layers ('t')", value=layout,
            pos=starts[i], fix=f"ldt builds each segment as a megatron-core GPTModel with at "
            f"least {minimum} layer(s): move a 't' into it from a neighbour, or use fewer stages")
    raise LayoutError(
        f"{num_layers} decoder layers cannot give each of the {len(segs)} chunks "
        f"({'U-shape: ' if u_shape else ''}{num_stages} stages) at least {minimum}",
        field="model.num_layers", value=num_layers,
        fix=f"use model.num_layers >= {len(segs) * minimum}, or fewer stages in cluster.stages")


def split_layers(num_layers: int, num_stages: int, *, u_shape: bool = False,
                 layout: str | None = None, min_chunk_layers: int = 0,
                 num_mtp: int | None = None) -> LayerSplit:
    """Place ``num_layers`` decoder layers (plus E, L, m) on ``num_stages`` pipeline stages.

    With ``layout`` (a non-blank string) the segments are checked and placed as described in the
    module docstring. Without one (``None`` or blank) the layers are split evenly:

    * plain: one segment per stage, E on the first, L on the last; each stage gets
      ``num_layers // P`` layers and the first ``num_layers % P`` stages get one more;
    * U-shape: P+1 segments (edge start, P-1 cloud stages, edge end), E on segment 0, L on
      segment P; each gets ``num_layers // (P+1)`` layers and the remainder goes one layer each to
      the cloud segments first (the edge is usually the weakest device), then to the edge's
      start segment. So every cloud stage gets a layer once ``num_layers >= P - 1``; with fewer
      layers the later cloud stages (and the edge chunks) are empty.

    ``min_chunk_layers=1`` refuses a chunk without a decoder layer (an empty segment, or one
    holding only ``E``/``L``): the grammar allows it, ldt's model build does not (every chunk is
    a GPTModel with at least one layer), so a training config asks for it.

    ``num_mtp`` (the model's MTP layers): an even split puts them in the head's segment, before
    ``L``; a layout must hold exactly that many ``m``. None: the grammar alone (no count).

    Raises :class:`LayoutError` naming the field, the value and the fix on any mismatch.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise LayoutError("needs at least one stage", field="cluster.stages", value=num_stages,
                          fix="list one entry per pipeline stage under cluster.stages")
    if not isinstance(num_layers, int) or num_layers < 0:
        raise LayoutError("must be a non-negative integer", field="model.num_layers",
                          value=num_layers, fix="set model.num_layers to the model's decoder layer count")
    if u_shape and num_stages < 2:
        raise LayoutError(f"u_shape needs at least 2 stages (edge + cloud), got {num_stages}",
                          field="cluster.u_shape", value=u_shape,
                          fix="add a cloud stage to cluster.stages, or set u_shape: false")
    starts: list = []
    if layout is None or (isinstance(layout, str) and not layout.strip()):
        segs = _even_segments(num_layers, num_stages, u_shape, num_mtp or 0)
    else:
        psegs = _parse(layout, starts)
        _validate(psegs, layout, num_layers, num_stages, u_shape, num_mtp)
        segs = [[sym for sym, _ in seg] for seg in psegs]
    _check_chunk_layers(segs, starts, layout, num_layers, num_stages, u_shape, min_chunk_layers)
    return _place(segs, num_layers, num_stages, u_shape)


def split_of_counts(layers: Sequence[int], num_stages: int, u_shape: bool = False) -> LayerSplit:
    """The split with ``layers[i]`` decoder layers in segment i (E on the first, L on the last;
    placed as :func:`split_layers` places a layout's segments), e.g. a planner's plan. Its
    :meth:`LayerSplit.to_layout_string` is the plan's ``cluster.layout``."""
    last = len(layers) - 1
    segs = [(["E"] if i == 0 else []) + ["t"] * n + (["L"] if i == last else [])
            for i, n in enumerate(layers)]
    return _place(segs, sum(layers), num_stages, u_shape)


def _place(segs: list[list[str]], num_layers: int, num_stages: int, u_shape: bool) -> LayerSplit:
    """Segments (token lists, model order) onto stages: the placement rule of the docstring."""
    per_stage: list[list[Chunk]] = [[] for _ in range(num_stages)]
    offset = 0
    for i, seg in enumerate(segs):
        if u_shape:
            stage, index = (i, 0) if i < num_stages else (0, 1)
        else:
            stage, index = i % num_stages, i // num_stages
        nt = seg.count("t")
        per_stage[stage].append(Chunk(stage=stage, index=index, segment=i, first_layer=offset,
                                      num_layers=nt, has_embedding="E" in seg, has_head="L" in seg,
                                      num_mtp=seg.count("m")))
        offset += nt
    return LayerSplit(num_stages=num_stages, u_shape=bool(u_shape),
                      chunks=tuple(tuple(cs) for cs in per_stage), num_layers=num_layers)
