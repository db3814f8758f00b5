"""Input preprocessing and augmentation as batched tensor ops on the actor's device.

``Preprocess`` turns stored rows into model inputs once, when a host loads its clients: uint8
images become float32 in [0, 1] (optionally inverted, 1 − x), optionally framed by ``pad``
black pixels (0) on each side (the model then sees the larger image: ``shape``), then
per-channel (x − mean) / std. Float rows (synthetic features, PCA or standardised features)
pass through.

``Augment`` runs on every training mini-batch, with torchvision's semantics and in the order of
DP-FedSAM's code (RandomCrop, RandomHorizontalFlip, RandomVerticalFlip, RandomGrayscale): a
random crop of the image padded with black pixels (pad p on each side, crop back to the input
size: ``RandomCrop(size, padding=p)``, which pads the pixels before ``Normalize``, so the
padding here is black in the normalised space of ``pixel_stats``), a horizontal and a vertical
flip each with probability ½, and with probability ``grayscale`` the image replaced by its
luminance 0.299 R + 0.587 G + 0.114 B in every channel (``RandomGrayscale``, whose default p is
0.1). The inputs are already normalised, so the luminance is taken of the pixel values
(``pixel_stats`` undoes and redoes the per-channel normalisation). Every transform makes one
draw per sample from a generator seeded per (seed, round, client), so runs are reproducible and
do not depend on which actor hosts a client; a transform that is off draws nothing. Evaluation
never augments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

LUMINANCE = (0.299, 0.587, 0.114)  # ITU-R 601-2, as PIL's convert("L") and torchvision


def per_channel(values: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    """``values`` shaped to broadcast over the channel axis of ``x`` (N, C, ...)."""
    return torch.tensor(values, device=x.device).view((1, -1) + (1,) * (x.dim() - 2))


@dataclass(frozen=True)
class Preprocess:
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    invert: bool = False  # TFF's federated EMNIST stores 1.0 = background
    pad: int = 0  # black pixels framing each side of an image (N, C, H, W)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8:
            return x
        x = x.float().div_(255.0)
        if self.invert:
            x = 1.0 - x
        if self.pad:
            x = F.pad(x, (self.pad,) * 4)
        if self.mean is not None:
            x = (x - per_channel(self.mean, x)) / per_channel(self.std, x)
        return x

    def shape(self, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The model input's shape for stored rows of ``x_shape`` (an image's grows by ``pad``
        on each side)."""
        if not self.pad or len(x_shape) != 3:
            return tuple(x_shape)
        channels, height, width = x_shape
        return channels, height + 2 * self.pad, width + 2 * self.pad

    def black(self, x: torch.Tensor) -> torch.Tensor:
        """A black pixel (0) in this normalised space, per channel, shaped to broadcast over
        the images ``x`` (N, C, H, W)."""
        if self.mean is None:
            return torch.zeros((1, x.shape[1], 1, 1), device=x.device)
        return -per_channel(self.mean, x) / per_channel(self.std, x)


@dataclass(frozen=True)
class Augment:
    padding: int = 0  # random crop of the image padded by this many zeros per side
    flip: bool = False  # horizontal flip with probability 1/2
    vertical_flip: bool = False  # vertical flip with probability 1/2
    grayscale: float = 0.0  # probability of replacing an RGB image by its luminance
    pixel_stats: Preprocess | None = None  # how the inputs were normalised (for grayscale)

    def __post_init__(self) -> None:
        if not 0.0 <= self.grayscale <= 1.0:
            raise ValueError(f"grayscale is a probability in [0, 1], got {self.grayscale}")

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Augment a batch (N, C, H, W); one draw per sample and transform from ``generator``."""
        if self.padding:
            x = self._random_crop(x, generator)
        if self.flip:
            x = torch.where(self._coin(x, 0.5, generator), x.flip(3), x)
        if self.vertical_flip:
            x = torch.where(self._coin(x, 0.5, generator), x.flip(2), x)
        if self.grayscale:
            x = torch.where(self._coin(x, self.grayscale, generator), self._luminance(x), x)
        return x.contiguous()

    @staticmethod
    def _coin(x: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
        """Per sample, True with probability ``p``; shaped (N, 1, 1, 1) to select samples."""
        hits = torch.rand(len(x), generator=generator, device=generator.device) < p
        return hits.to(x.device)[:, None, None, None]

    def _random_crop(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        n, c, h, w = x.shape
        p = self.padding
        stats = self.pixel_stats or Preprocess()
        if not any(stats.mean or ()):  # black is 0: decided on the host, no device sync
            padded = F.pad(x, (p, p, p, p))
        else:
            padded = stats.black(x).expand(n, c, h + 2 * p, w + 2 * p).clone()
            padded[:, :, p : p + h, p : p + w] = x
        dy = torch.randint(0, 2 * p + 1, (n,), generator=generator, device=generator.device)
        dx = torch.randint(0, 2 * p + 1, (n,), generator=generator, device=generator.device)
        rows = (dy.to(x.device)[:, None] + torch.arange(h, device=x.device))[:, :, None]
        cols = (dx.to(x.device)[:, None] + torch.arange(w, device=x.device))[:, None, :]
        batch = torch.arange(n, device=x.device)[:, None, None]
        # padded[b, :, rows[b, i], cols[b, j]] for every sample b → (N, H, W, C)
        return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)

    def _luminance(self, x: torch.Tensor) -> torch.Tensor:
        """Every sample of the RGB batch ``x`` as its luminance in all three channels, in the
        normalised space of ``pixel_stats`` (identity stats when it is None)."""
        if x.shape[1] != 3:
            raise ValueError(f"grayscale needs RGB images (N, 3, H, W), got {tuple(x.shape)}")
        stats = self.pixel_stats or Preprocess()
        mean = per_channel(stats.mean or (0.0,) * 3, x)
        std = per_channel(stats.std or (1.0,) * 3, x)
        weights = per_channel(LUMINANCE, x)
        gray = ((x * std + mean) * weights).sum(dim=1, keepdim=True)
        return (gray - mean) / std
