"""The defence knob: Gaussian noise on what a data-owning stage sends (``train.boundary_noise``).

Every tensor a data stage's leader sends across a boundary (on the U-shape: the edge's
activations to the first cloud stage and its gradients back to the last) gets i.i.d. noise of
standard deviation ``boundary_noise * RMS(tensor)``. The scale is one number per message, not
per token, so the noise also blurs how token vectors differ in norm (what the norm attack on
labels reads). It is a measured trade-off, not a formal guarantee: ``ldt-audit`` reports what
the cloud still recovers and what the loss pays (docs/privacy.md).
"""

from __future__ import annotations

import hashlib

import torch

from ldt.boundary.communicator import SendTransform


class BoundaryNoise(SendTransform):
    """A send transform of :class:`ldt.boundary.communicator.VtpCommunicator`:
    ``x + N(0, (scale * rms(x))^2)``.

    Each message draws from a generator of its own, seeded by the pass, its channel (source,
    destination, direction) and its number on that channel in the pass. Every rank of a data
    stage counts every message the stage sends, those it sends itself and those a rank beside
    it sends (:meth:`skip`): so the ranks that each send a copy of one message (fan-out) draw
    the same noise, however many copies each sent before (a TP 2 edge fans out to a TP 2
    stage but only its leader sends to a TP 1 stage)."""

    def __init__(self, scale: float, seed: int):
        self.scale, self.seed = float(scale), int(seed)
        self.start(-1)

    def start(self, step: int, evaluation: bool = False) -> None:
        """Begin the draws of step ``step``'s pass (its training pass, or its evaluation):
        each pass has a stream of its own, so a run resumed at any step (from a checkpoint or
        a snapshot) sends the noise the uninterrupted run sent, whatever passes came before."""
        self._stream = self.seed + 1_000_003 * (2 * step + 1 + int(evaluation))
        self._sent: dict[tuple, int] = {}

    def __call__(self, tensor: torch.Tensor, src: int, dst: int, direction: str) -> torch.Tensor:
        x = tensor.detach().float()
        rms = x.pow(2).mean().sqrt()
        generator = torch.Generator(device=x.device).manual_seed(
            self._message_seed(src, dst, direction))
        noise = torch.randn(x.shape, generator=generator, device=x.device)
        return (x + noise * (self.scale * rms)).to(tensor.dtype)

    def skip(self, src: int, dst: int, direction: str) -> None:
        """A message of this stage that another rank of it sends: counted, not drawn."""
        self._message_seed(src, dst, direction)

    def _message_seed(self, src: int, dst: int, direction: str) -> int:
        channel = (src, dst, direction)
        number = self._sent.get(channel, 0)
        self._sent[channel] = number + 1
        # a hash, not a sum: no two (pass, channel, number) share a seed
        text = f"{self._stream} {src} {dst} {direction} {number}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def send_transforms(train, topo, stage: int, replica: int = 0) -> list:
    """The transforms the sends of ``stage``'s data-parallel ``replica`` go through: noise on
    data stages when configured."""
    if train.boundary_noise > 0 and stage in topo.data_stages():
        # a seed of its own per stage and replica, apart from the weight and data seeds of
        # train.seed. Replicas drawing the same noise would let the cloud, which receives every
        # replica's messages, cancel it: a scaled difference of two of them is noise-free.
        seed = train.seed * 7_919 + 104_729 * (stage + 1) + 15_485_863 * replica
        return [BoundaryNoise(train.boundary_noise, seed=seed)]
    return []
