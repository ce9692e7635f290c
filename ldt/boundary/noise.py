"""The defence knob: Gaussian noise on what a data-owning stage sends (``train.boundary_noise``).

Every tensor a data stage's leader sends across a boundary (on the U-shape: the edge's
activations to the first cloud stage and its gradients back to the last) gets i.i.d. noise of
standard deviation ``boundary_noise * RMS(tensor)``. The scale is one number per message, not
per token, so the noise also blurs how token vectors differ in norm (what the norm attack on
labels reads). It is a measured trade-off, not a formal guarantee: ``ldt-audit`` reports what
the cloud still recovers and what the loss pays (docs/privacy.md).
"""

from __future__ import annotations

import torch


class BoundaryNoise:
    """A send transform of :class:`ldt.boundary.communicator.VtpCommunicator`:
    ``x + N(0, (scale * rms(x))^2)``."""

    def __init__(self, scale: float, seed: int):
        self.scale, self.seed = float(scale), int(seed)
        self._stream = self.seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def start(self, step: int, evaluation: bool = False) -> None:
        """Begin the draws of step ``step``'s pass (its training pass, or its evaluation):
        each pass has a stream of its own, so a run resumed at any step (from a checkpoint or
        a snapshot) sends the noise the uninterrupted run sent, whatever passes came before."""
        self._stream = self.seed + 1_000_003 * (2 * step + 1 + int(evaluation))
        self._generators.clear()

    def __call__(self, tensor: torch.Tensor, src: int, dst: int, direction: str) -> torch.Tensor:
        x = tensor.detach().float()
        rms = x.pow(2).mean().sqrt()
        noise = torch.randn(x.shape, generator=self._generator(x.device), device=x.device)
        return (x + noise * (self.scale * rms)).to(tensor.dtype)

    def _generator(self, device: torch.device) -> torch.Generator:
        # seeded per stage, pass and device, so a run (and an audit of it) is reproducible
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._stream)
        return self._generators[device]


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
