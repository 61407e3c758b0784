"""trace/lengths.py: knot updates derived from three lengths and a check per micro-batch, against the same
figures computed directly at every shape (a synthetic update whose storages are sized like a transformer's),
and the fall-back to tracing every shape where sizes are not parabolas in s."""
from __future__ import annotations

from batchlab.config.phase import Phase
from batchlab.trace.lengths import Run, at_shapes

F, B = Phase.FORWARD, Phase.BACKWARD
LENGTHS = [16, 64, 128, 192, 256, 320, 384, 512]
SHAPES = [(b, s) for b in (1, 2, 3) for s in LENGTHS]


def _update(b: int, s: int, cube: bool = False) -> Run:
    """Live bytes after each storage: params, a b·s·w activation, a b·h·s² score (at b = 1 an s² mask stays
    unexpanded), a per-sample scalar, freed scores, gradients; optionally one s³ storage."""
    sizes = [4096, b * s * 64, (b if b > 1 else 0) * 4 * s * s + s * s, b * 8, b * s ** 3 if cube else 0]
    live, current = [], 0
    for n in sizes:
        current += n
        live.append(current)
    current -= sizes[2]  # the scores freed before backward
    for n in (b * s * 64, 4096, 4096):
        current += n
        live.append(current)
    phases = (F,) * len(sizes) + (B,) * 3
    return Run((("ops",), phases), (b * s * 64, live[len(sizes) - 1], 0), tuple(live))


def _traced(cube: bool = False):
    calls = []

    def trace(b, s):
        calls.append((b, s))
        return _update(b, s, cube)
    return trace, calls


def test_derived_shapes_equal_the_direct_figures_with_eleven_traced():
    trace, calls = _traced()
    runs = at_shapes(trace, SHAPES)
    assert {k: r.figures() for k, r in runs.items()} == {k: _update(*k).figures() for k in SHAPES}
    assert len(calls) == 11 and len(set(calls)) == 11  # 3 lengths per micro-batch, checks at b = 1 and 2


def test_sizes_not_parabolas_in_s_are_traced_at_every_shape():
    trace, calls = _traced(cube=True)
    runs = at_shapes(trace, SHAPES)
    assert {k: r.figures() for k, r in runs.items()} == {k: _update(*k, cube=True).figures() for k in SHAPES}
    assert len(calls) == len(SHAPES)


def test_few_lengths_are_all_traced():
    trace, calls = _traced()
    shapes = [(b, s) for b in (1, 2, 3) for s in LENGTHS[:4]]
    at_shapes(trace, shapes)
    assert sorted(calls) == sorted(shapes)
