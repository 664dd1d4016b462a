"""The encoder cache: each prompt image's projected embeddings, computed once and kept
while some request still has placeholder positions of it to feed.

Chunked prefill may split an image's placeholder span over several steps, and a prefix
hit may start a request in the middle of one; the vision tower always encodes the whole
image (its rows attend to each other), so the embeddings are kept here, keyed by the
image's content hash, from the chunk that brings its pixels (``SeqChunk.images``) until
every request holding it has fed the span's last position (or was released). Two
requests with the same image share one entry and one encoding.

A chunk naming an image that is neither cached nor carries its pixels, or pixels of the
wrong shape, is a plan the scheduler should never send: a ValueError (the step fails).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from protocol.ipc import ImageInput, SeqChunk


class ImageCache:
    """``vision``: the model's image path (``models/vision.py``: ``input_problem(im)``
    says why an image does not fit it, ``embed(pixels, im)`` gives its embeddings
    [tokens, hidden]); None: this model takes no images."""

    def __init__(self, vision=None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.vision = vision
        self.device, self.dtype = torch.device(device), dtype
        self.embeddings: dict[bytes, torch.Tensor] = {}  # content hash -> [tokens, hidden]
        self.holders: dict[bytes, set[str]] = {}  # content hash -> rids still feeding its span
        self.pending: dict[bytes, ImageInput] = {}  # pixels this step brought, not yet encoded
        self.encoded = 0  # images run through the tower so far (tests read it)

    def __len__(self) -> int:
        return len(self.embeddings) + len(self.pending)

    def admit(self, seq: SeqChunk) -> None:
        """Take note of the chunk's images before the step runs; check what came."""
        if not seq.images:
            return
        if self.vision is None:
            raise ValueError(f"{seq.rid}: images sent to a model without a vision tower")
        start, end = seq.start_pos, seq.start_pos + len(seq.token_ids)
        for im in seq.images:
            if not (im.offset < end and im.offset + im.length > start):
                raise ValueError(f"{seq.rid}: image at {im.offset}..{im.offset + im.length - 1} "
                                 f"is outside the chunk's positions {start}..{end - 1}")
            problem = self.vision.input_problem(im)
            if problem is not None:
                raise ValueError(f"{seq.rid}: {problem}")
            key = im.content_hash
            if key not in self.embeddings and key not in self.pending:
                if not im.pixels:
                    raise ValueError(f"{seq.rid}: an image's pixels were never sent and its "
                                     "embeddings are not cached")
                if len(im.pixels) != 4 * math.prod(im.shape):
                    raise ValueError(f"{seq.rid}: {len(im.pixels)} bytes of pixels for shape "
                                     f"{im.shape} float32")
                self.pending[key] = im
            self.holders.setdefault(key, set()).add(seq.rid)

    def _encode_pending(self) -> None:
        """Each image alone (its embeddings never depend on what else came in the step)."""
        for key, im in self.pending.items():
            pixels = torch.from_numpy(np.frombuffer(im.pixels, dtype=np.float32).reshape(im.shape).copy())
            self.embeddings[key] = self.vision.embed(pixels.to(self.device), im).to(self.dtype)
            self.encoded += 1
        self.pending.clear()

    def gather(self, ordered: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the flattened step, their embeddings) for every image position fed in
        this step (``ordered``: the forward order); None when there is none."""
        if not any(s.images for s in ordered):
            return None
        self._encode_pending()
        rows: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        base = 0
        for s in ordered:
            start, n = s.start_pos, len(s.token_ids)
            for im in s.images:
                lo, hi = max(start, im.offset), min(start + n, im.offset + im.length)
                rows.append(torch.arange(base + lo - start, base + hi - start))
                embeds.append(self.embeddings[im.content_hash][lo - im.offset:hi - im.offset])
            base += n
        return torch.cat(rows).to(self.device), torch.cat(embeds)

    def finish(self, seqs: list[SeqChunk]) -> None:
        """After a step: a request whose chunk fed an image's last position holds it no more."""
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            for im in s.images:
                if end >= im.offset + im.length:
                    self._drop(im.content_hash, s.rid)

    def release(self, rid: str) -> None:
        for key in [k for k, rids in self.holders.items() if rid in rids]:
            self._drop(key, rid)

    def _drop(self, key: bytes, rid: str) -> None:
        rids = self.holders.get(key)
        if rids is None:
            return
        rids.discard(rid)
        if not rids:
            del self.holders[key]
            self.embeddings.pop(key, None)
            self.pending.pop(key, None)
