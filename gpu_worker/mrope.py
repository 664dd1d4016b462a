"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL) of one chunk's rows, from the chunk alone.

HF's ``get_rope_index`` positions a prompt as: text tokens count up by one; an image's
tokens, laid out as its [1, rows, columns] grid, sit at (base, base + row, base + column)
with base the position the next text token would have had; the text after the image goes
on from base + max(rows, columns). So every position after an image is its index plus the
gains (``ImageInput.rope_gain``) of the images before it, and decoding continues from the
prompt's length plus all of them (HF's ``rope_deltas``).

A chunk carries the gains of the images that end before it (``SeqChunk.rope_shift``, the
scheduler's sum) and the images its rows overlap, which is all it takes: the same
positions whether the prompt was prefilled in one chunk or many, from a prefix hit, or
recomputed after preemption.
"""

from __future__ import annotations

from protocol.ipc import SeqChunk


def positions(seq: SeqChunk) -> tuple[list[int], list[list[int]] | None]:
    """(one position per row: index + shift, as text and decode rows take it; the
    (temporal, height, width) rows, or None when no image of the chunk has a grid)."""
    start, n, shift = seq.start_pos, len(seq.token_ids), seq.rope_shift
    gridded = [im for im in seq.images if im.grid]
    if not gridded:
        return list(range(start + shift, start + n + shift)), None
    flat: list[int] = []
    axes: list[list[int]] = [[], [], []]
    images = iter(sorted(gridded, key=lambda im: im.offset))
    im = next(images, None)
    for p in range(start, start + n):
        while im is not None and p >= im.offset + im.length:
            shift += im.rope_gain
            im = next(images, None)
        if im is not None and p >= im.offset:
            k, cols = p - im.offset, im.grid[2]
            base = im.offset + shift
            t, h, w = base, base + k // cols, base + k % cols
        else:
            t = h = w = p + shift
        flat.append(t)
        for axis, value in zip(axes, (t, h, w)):
            axis.append(value)
    return flat, axes
