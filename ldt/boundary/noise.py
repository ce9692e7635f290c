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
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, tensor: torch.Tensor, src: int, dst: int, direction: str) -> torch.Tensor:
        x = tensor.detach().float()
        rms = x.pow(2).mean().sqrt()
        noise = torch.randn(x.shape, generator=self._generator(x.device), device=x.device)
        return (x + noise * (self.scale * rms)).to(tensor.dtype)

    def _generator(self, device: torch.device) -> torch.Generator:
        # seeded per stage and device, so a run (and an audit of it) is reproducible
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]


def send_transforms(train, topo, stage: int) -> list:
    """The transforms ``stage``'s sends go through: noise on data stages when configured."""
    if train.boundary_noise > 0 and stage in topo.data_stages():
        # a seed of its own per stage, apart from the weight and data seeds of train.seed
        seed = train.seed * 7_919 + 104_729 * (stage + 1)
        return [BoundaryNoise(train.boundary_noise, seed=seed)]
    return []
