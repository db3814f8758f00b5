"""Tasks: named pairings of data sources with a model, input preprocessing and augmentation.

Every task is classification: the loss is mean cross-entropy and the metrics are loss and top-1
accuracy. ``sources`` lists the data sources a task accepts (the first is its usual one).

::

 | task               | sources                    | model        | augmentation        |
 |--------------------|----------------------------|--------------|---------------------|
 | synthetic_logreg   | synthetic                  | logreg       | —                   |
 | mnist_cnn          | mnist, mnist_test_split    | mnist_cnn    | —                   |
 | emnist_cnn         | emnist                     | emnist_cnn   | —                   |
 | emnist_logreg      | emnist                     | logreg       | —                   |
 | mnist_pca_mlp      | mnist, mnist_test_split    | mlp_pca60    | — (PCA-60 features) |
 | femnist_cnn        | femnist                    | reddi_cnn    | —                   |
 | cifar10_resnet18   | cifar10                    | resnet18_gn  | crop 32 pad 4, flip |
 | cifar100_resnet18  | cifar100                   | resnet18_gn  | crop 32 pad 4, flip |
 | cifar10_resnet10   | cifar10                    | resnet10_gn  | crop 32 pad 4, flip |
 | cifar100_resnet10  | cifar100                   | resnet10_gn  | crop 32 pad 4, flip |
 | cifar10_resnet18_gn2, cifar100_resnet18_gn2 | cifar10, cifar100 | resnet18_gn2 | crop, flip |
 | femnist_resnet18   | femnist                    | resnet18_gn  | —                   |
 | cifar10_vit_b16, cifar100_vit_b16 | cifar10, cifar100 | vit_b16 | crop 32 pad 4, flip; → 224 |
 | sst2/qqp/mrpc/qnli_roberta_base | sst2, qqp, mrpc, qnli | roberta_base | — (token ids) |
 | cifar10_cnn2       | cifar10                    | reddi_cnn    | crop 32 pad 4, flip |
 | cifar10_resnet9    | cifar10                    | resnet9      | crop 32 pad 4, flip |
 | cifar100_resnet9   | cifar100                   | resnet9      | crop 32 pad 4, flip |
 | cifar10_resnet18_flips_gray, cifar100_resnet18_flips_gray | cifar10, cifar100 | resnet18_gn |
 |                    |  crop 32 pad 4, flip, vertical flip, grayscale p 0.1    |              |
 | emnist_cnn_crop_flips | emnist               | emnist_cnn | frame 2: 32×32; crop pad 2, flips |

``emnist_cnn`` runs DP-FedSAM's CNN on the 28×28 images (its dense layer follows the input
size: 608,702 parameters); ``emnist_cnn_crop_flips`` on the authors' 32×32 inputs (903,614).
``femnist_cnn`` keeps TFF's polarity (1 = background), as Reddi et al.'s TFF pipeline does.
The papers' other pairings: DP-FedPGN's ResNet-10 on CIFAR-100 and its ResNet-18 with
GroupNorm(2) (``*_resnet18_gn2``; DP-FedSAM's has 32 groups); BLUR+LUS's ResNet-18 on EMNIST
by writer (``femnist_resnet18``: the TFF federated EMNIST of 3,400 writers is our ``femnist``;
the paper leaves its normalisation layer unstated, GroupNorm(32) here) and its "CNN-2-Layers"
on CIFAR-10 (``cifar10_cnn2``; the paper states no augmentation, this task uses the CIFAR one).
DP-FedSAM's code augments with RandomCrop(32, padding=4), horizontal and vertical flips (p ½)
and RandomGrayscale (p 0.1): ``*_resnet18_flips_gray`` on CIFAR, ``emnist_cnn_crop_flips`` on
EMNIST, whose code crops 32×32 from the 28×28 image padded by 4 and does not normalise: here
the image is framed by 2 black pixels once (32×32, what the model and the evaluation see) and
cropped back to 32 from a 2-pixel black padding, the same offsets of the same padded image
(grayscale is the identity on one channel; the code's evaluation crops and flips at random too,
here it sees the centred image). Crops pad with black pixels, as torchvision pads before
normalising. Rows stored as floats (PCA features, ``data.standardize_unit_norm``) skip a task's
pixel statistics (``Preprocess`` scales uint8 images only).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from datasets.augment import Augment, Preprocess
from datasets.glue import GLUE_SOURCES
from models import MODELS, PRETRAINED_LOADERS

MNIST_STATS = Preprocess(mean=(0.1307,), std=(0.3081,))
CIFAR10_STATS = Preprocess(mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616))
CIFAR100_STATS = Preprocess(mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762))


def cifar_augment(stats: Preprocess) -> Augment:
    """Crop 32 with padding 4 (black) and a horizontal flip, on inputs normalised with ``stats``."""
    return Augment(padding=4, flip=True, pixel_stats=stats)


CIFAR10_AUGMENT, CIFAR100_AUGMENT = cifar_augment(CIFAR10_STATS), cifar_augment(CIFAR100_STATS)


def dpfedsam_cifar_augment(stats: Preprocess) -> Augment:
    """DP-FedSAM's CIFAR augmentation, on inputs normalised with ``stats``."""
    return Augment(padding=4, flip=True, vertical_flip=True, grayscale=0.1, pixel_stats=stats)


# DP-FedSAM's EMNIST code: RandomCrop(32, padding=4) of the 28×28 image, flips, no Normalize.
# Framed by 2 black pixels once (32×32, what the model and the evaluation see), then cropped
# back to 32 from a 2-pixel padding: the same offsets (0-4) of the same black-padded image.
DPFEDSAM_EMNIST_INPUT = Preprocess(pad=2)
DPFEDSAM_EMNIST_AUGMENT = Augment(padding=2, flip=True, vertical_flip=True)


@dataclass(frozen=True)
class Task:
    name: str
    sources: tuple[str, ...]
    model_name: str
    preprocess: Preprocess = field(default_factory=Preprocess)
    augment: Augment | None = None

    def model(self, x_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        """The model for stored rows of ``x_shape`` (what ``preprocess`` makes of them)."""
        return MODELS[self.model_name](self.preprocess.shape(tuple(x_shape)), int(num_classes))

    def augment_for(self, x_dtype: str) -> Augment | None:
        """``augment`` for stored rows of ``x_dtype``: rows stored as floats (standardised or
        PCA features) skip the pixel statistics, so their crops pad with 0, not with the
        normalised black of the task's images."""
        if self.augment is None or x_dtype == "uint8":
            return self.augment
        return replace(self.augment, pixel_stats=None)

    def load_pretrained(self, model: nn.Module, folder: Path | None) -> None:
        """Initialise ``model`` from the pretrained ``folder`` (None: keep the seeded random
        initialisation) where the task's model reads one (``models.PRETRAINED_LOADERS``)."""
        if folder is not None and self.model_name in PRETRAINED_LOADERS:
            PRETRAINED_LOADERS[self.model_name](model, folder)

    @staticmethod
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, y)


_TASKS = [
    Task("synthetic_logreg", ("synthetic",), "logreg"),
    Task("mnist_cnn", ("mnist", "mnist_test_split"), "mnist_cnn", MNIST_STATS),
    Task("emnist_cnn", ("emnist",), "emnist_cnn", MNIST_STATS),
    Task("emnist_logreg", ("emnist",), "logreg", MNIST_STATS),
    Task("mnist_pca_mlp", ("mnist", "mnist_test_split"), "mlp_pca60"),  # data.pca_components
    Task("femnist_cnn", ("femnist",), "reddi_cnn"),
    Task("cifar10_resnet18", ("cifar10",), "resnet18_gn", CIFAR10_STATS, CIFAR10_AUGMENT),
    Task("cifar100_resnet18", ("cifar100",), "resnet18_gn", CIFAR100_STATS, CIFAR100_AUGMENT),
    Task("cifar10_resnet10", ("cifar10",), "resnet10_gn", CIFAR10_STATS, CIFAR10_AUGMENT),
    Task("cifar100_resnet10", ("cifar100",), "resnet10_gn", CIFAR100_STATS, CIFAR100_AUGMENT),
    Task("cifar10_resnet18_gn2", ("cifar10",), "resnet18_gn2", CIFAR10_STATS, CIFAR10_AUGMENT),
    Task("cifar100_resnet18_gn2", ("cifar100",), "resnet18_gn2", CIFAR100_STATS, CIFAR100_AUGMENT),
    Task("femnist_resnet18", ("femnist",), "resnet18_gn"),
    # DP-FedPGN's transformers (Table V), fine-tuned from data.pretrained: ViT-B/16 resizes the
    # augmented 32×32 batch to 224×224 in its forward; GLUE rows are RoBERTa token ids.
    Task("cifar10_vit_b16", ("cifar10",), "vit_b16", CIFAR10_STATS, CIFAR10_AUGMENT),
    Task("cifar100_vit_b16", ("cifar100",), "vit_b16", CIFAR100_STATS, CIFAR100_AUGMENT),
    *(Task(f"{glue}_roberta_base", (glue,), "roberta_base") for glue in GLUE_SOURCES),
    Task("cifar10_cnn2", ("cifar10",), "reddi_cnn", CIFAR10_STATS, CIFAR10_AUGMENT),
    Task("cifar10_resnet9", ("cifar10",), "resnet9", CIFAR10_STATS, CIFAR10_AUGMENT),
    Task("cifar100_resnet9", ("cifar100",), "resnet9", CIFAR100_STATS, CIFAR100_AUGMENT),
    Task(
        "cifar10_resnet18_flips_gray",
        ("cifar10",),
        "resnet18_gn",
        CIFAR10_STATS,
        dpfedsam_cifar_augment(CIFAR10_STATS),
    ),
    Task(
        "cifar100_resnet18_flips_gray",
        ("cifar100",),
        "resnet18_gn",
        CIFAR100_STATS,
        dpfedsam_cifar_augment(CIFAR100_STATS),
    ),
    Task(
        "emnist_cnn_crop_flips",
        ("emnist",),
        "emnist_cnn",
        DPFEDSAM_EMNIST_INPUT,
        DPFEDSAM_EMNIST_AUGMENT,
    ),
]
TASKS: dict[str, Task] = {task.name: task for task in _TASKS}
