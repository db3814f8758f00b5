"""Model definitions (plain PyTorch). Models meant for DP use GroupNorm, never BatchNorm.

``MODELS`` maps a model name to a factory ``(input shape without the batch dim, num_classes) →
nn.Module``. Every model returns logits (the softmax lives in the loss), has no buffers and no
BatchNorm, and works with ``torch.func`` per-sample gradients (``functional_call`` + ``vmap`` +
``grad``; a model with dropout needs ``vmap(..., randomness="different")`` in training mode).

=============  ====================================================  =====================
name           model                                                 input shape
=============  ====================================================  =====================
logreg         multinomial logistic regression (DP-SCAFFOLD)         any; flattened
emnist_cnn     DP-FedSAM's EMNIST CNN                                (C, H, W) or (H, W)
reddi_cnn      Reddi et al.'s 2-layer CNN (BLUR+LUS)                 (C, H, W) or (H, W)
mnist_cnn      ``emnist_cnn`` (no spec defines an MNIST CNN)         (C, H, W) or (H, W)
resnet10_gn    CIFAR ResNet-10, GroupNorm(2) (DP-FedPGN)             (C, H, W)
resnet18_gn    CIFAR ResNet-18, GroupNorm(32) (DP-FedSAM)            (C, H, W)
resnet9        FetchSGD's ResNet9, GroupNorm(32) (DPSFL)             (C, H, W)
mlp_pca60      60 → 200 ReLU → classes (DP-SCAFFOLD, PCA-60 MNIST)   (60,)
vit_b16        ViT-B/16 at 224×224, timm's keys (DP-FedPGN)          (3, H, W); resized to 224
roberta_base   RoBERTa-base classifier, HF's keys (DP-FedPGN)        (L,) token ids, L <= 512
=============  ====================================================  =====================

``PRETRAINED_LOADERS`` maps the models that start from pretrained weights to a loader
``(model, folder)`` reading a local timm / Hugging Face folder (``models.vit``,
``models.roberta``); the classifier head is always the model's own, sized for the task.

The CNNs size their dense layers from (H, W): ``emnist_cnn`` on (1, 32, 32) is DP-FedSAM's
model, on (1, 28, 28) it is ``mnist_cnn``. A 2-D shape (H, W) means one channel.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from math import prod
from pathlib import Path

from torch import nn

from models.cnn import EmnistCnn, ReddiCnn
from models.logreg import LogisticRegression
from models.mlp import Mlp
from models.resnet import resnet10_gn, resnet18_gn
from models.resnet9 import ResNet9
from models.roberta import ROBERTA_BASE, build_roberta, load_hf_folder
from models.vit import VIT_B16, build_vit, load_timm_folder

ModelFactory = Callable[[tuple[int, ...], int], nn.Module]

# Layers that draw from torch's process-wide generator, not from an explicit torch.Generator.
GLOBAL_RNG_LAYERS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def draws_from_global_rng(model: nn.Module) -> bool:
    """Whether training ``model`` draws from torch's global generator (dropout), which the
    client code seeds per client: two clients trained at once in one process would interleave
    their seeds and draws."""
    return any(isinstance(m, GLOBAL_RNG_LAYERS) for m in model.modules())


def input_problem(name: str, shape: tuple[int, ...]) -> str | None:
    """Why model ``name`` cannot take rows of ``shape`` (None: it can), known before it is
    built: the config checks ask it of the rows a source gives after its preprocessing."""
    if name in _IMAGE_MODELS and len(shape) not in (2, 3):
        return f"model {name!r} needs an image shape (C, H, W) or (H, W), got {shape}"
    if name == "mlp_pca60" and prod(shape) != 60:
        return (
            f"model 'mlp_pca60' takes the 60 PCA features of DP-SCAFFOLD's MNIST setup, got "
            f"input shape {shape}"
        )
    return None


def _image_shape(name: str, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(C, H, W) from a (C, H, W) or one-channel (H, W) input shape."""
    problem = input_problem(name, shape)
    if problem is not None:
        raise ValueError(problem)
    return (1, *shape) if len(shape) == 2 else tuple(shape)


# Models on images: name -> constructor (num_classes, channels, (H, W)).
_IMAGE_MODELS: dict[str, Callable[[int, int, tuple[int, int]], nn.Module]] = {
    "emnist_cnn": EmnistCnn,
    "reddi_cnn": ReddiCnn,
    "mnist_cnn": EmnistCnn,
    "resnet10_gn": lambda k, c, _: resnet10_gn(k, c),
    "resnet18_gn": lambda k, c, _: resnet18_gn(k, c),
    "resnet18_gn2": lambda k, c, _: resnet18_gn(k, c, num_groups=2),  # DP-FedPGN's
    "resnet9": lambda k, c, _: ResNet9(k, c),
}


def _image_model(name: str, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, h, w = _image_shape(name, shape)
    return _IMAGE_MODELS[name](num_classes, c, (h, w))


def _mlp_pca60(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    problem = input_problem("mlp_pca60", shape)
    if problem is not None:
        raise ValueError(f"{problem}; apply the PCA in preprocessing, or build models.mlp.Mlp")
    return Mlp(60, 200, num_classes)


MODELS: dict[str, ModelFactory] = {
    "logreg": lambda shape, k: LogisticRegression(prod(shape), k),
    **{name: partial(_image_model, name) for name in _IMAGE_MODELS},
    "mlp_pca60": _mlp_pca60,
    "vit_b16": partial(build_vit, VIT_B16),
    "roberta_base": partial(build_roberta, ROBERTA_BASE),
}
PRETRAINED_LOADERS: dict[str, Callable[[nn.Module, Path], None]] = {
    "vit_b16": load_timm_folder,
    "roberta_base": load_hf_folder,
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``MODELS[name](input_shape, num_classes)``, with a clear error for an unknown name."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name](tuple(input_shape), int(num_classes))


__all__ = [
    "MODELS",
    "EmnistCnn",
    "LogisticRegression",
    "Mlp",
    "ModelFactory",
    "PRETRAINED_LOADERS",
    "ReddiCnn",
    "ResNet9",
    "build_model",
    "input_problem",
    "resnet10_gn",
    "resnet18_gn",
]
