"""Vision Transformer (Dosovitskiy et al.) with timm's ``VisionTransformer`` parameter names.

The state-dict keys are timm's ``vit_base_patch16_224`` (``patch_embed.proj``, ``cls_token``,
``pos_embed``, ``blocks.{i}.norm1/attn.qkv/attn.proj/norm2/mlp.fc1/mlp.fc2``, ``norm``,
``head``), so timm's checkpoints load as they are (``load_timm_folder``). Pre-norm blocks,
LayerNorm ε = 1e-6, exact GELU, class-token pooling, no dropout (timm's defaults for this
model), no BatchNorm and no buffers: ``torch.func.functional_call`` and ``vmap`` apply.

Inputs smaller than ``image_size`` (CIFAR's 32×32 rows) are resized bilinearly to it inside
``forward``, on the device that runs the model: the store keeps the 32×32 images and a batch is
resized after its augmentation. Per-channel normalisation commutes with that resize, so the
task's ``Preprocess`` may run first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from models.attention import merge_heads, split_heads
from models.pretrained import check_config, load_checked, read_config, read_weights, weights_file


@dataclass(frozen=True)
class ViTConfig:
    """Architecture hyperparameters; ``architecture`` is timm's name, checked against a
    pretrained folder's ``config.json``."""

    architecture: str = "vit_base_patch16_224"
    image_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    layer_norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


VIT_B16 = ViTConfig()


class Attention(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v)))


class Mlp(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.dim, config.mlp_dim)
        self.fc2 = nn.Linear(config.mlp_dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.mlp = Mlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.proj = nn.Conv2d(
            config.in_chans, config.dim, config.patch_size, stride=config.patch_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, patches, dim)


class VisionTransformer(nn.Module):
    """ViT classifier: ``forward`` maps (B, C, H, W) images to (B, num_classes) logits."""

    def __init__(self, config: ViTConfig, num_classes: int):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, config.num_patches + 1, config.dim))
        self.blocks = nn.Sequential(*(Block(config) for _ in range(config.depth)))
        self.norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.head = nn.Linear(config.dim, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """timm's ``init_weights_vit_timm``: linear weights and the position embedding
        truncated-normal(0.02), biases 0, the class token normal(1e-6)."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        if x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        tokens = self.patch_embed(x)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        tokens = torch.cat([cls, tokens], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(tokens))[:, 0])


def build_vit(config: ViTConfig, shape: tuple[int, ...], num_classes: int) -> VisionTransformer:
    """A ViT for (C, H, W) rows; C must be the model's input channels."""
    if len(shape) != 3 or shape[0] != config.in_chans:
        raise ValueError(
            f"{config.architecture} takes images ({config.in_chans}, H, W), got rows {shape}"
        )
    return VisionTransformer(config, num_classes)


# Not model tensors: a pre-logits layer of old in21k checkpoints would be one, and is refused.
HEAD_PREFIXES = ("head.",)


def load_timm_folder(model: VisionTransformer, folder: Path) -> None:
    """Initialise ``model`` from a timm folder (``config.json`` whose ``architecture`` is the
    model's, weights in ``model.safetensors`` or ``pytorch_model.bin``); the head stays the
    model's own, sized for the task."""
    check_config(
        folder / "config.json",
        read_config(folder),
        {"architecture": model.config.architecture},
    )
    path = weights_file(folder)
    load_checked(model, path, read_weights(path), HEAD_PREFIXES)
