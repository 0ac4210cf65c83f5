"""Hypothesis packings of a pool of documents for the transformers-integration parity tests."""

from __future__ import annotations

from hypothesis import strategies as st


def document_packings(lengths: list[int], worlds=(1, 2, 4)):
    """``(world, rows, seq)``: a CP size from ``worlds``; one or two rows, each 1-4 distinct
    documents of the pool (indices into ``lengths``, no document twice in the batch); the row
    length ``seq`` is the longest row plus 0-7 pad tokens."""

    @st.composite
    def packing(draw):
        world = draw(st.sampled_from(list(worlds)))
        order = draw(st.permutations(range(len(lengths))))
        rows, used = [], 0
        for _ in range(draw(st.integers(1, 2))):
            k = draw(st.integers(1, 4))
            rows.append(list(order[used : used + k]))
            used += k
        longest = max(sum(lengths[i] for i in row) for row in rows)
        return world, rows, longest + draw(st.integers(0, 7))

    return packing()
