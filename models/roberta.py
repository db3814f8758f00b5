"""RoBERTa (Liu et al.) for sequence classification, with Hugging Face's parameter names.

The state-dict keys are ``transformers``' ``RobertaForSequenceClassification``
(``roberta.embeddings.*``, ``roberta.encoder.layer.{i}.attention.self.query/key/value``,
``...attention.output.dense/LayerNorm``, ``...intermediate.dense``, ``...output.dense/LayerNorm``,
``classifier.dense``, ``classifier.out_proj``), so the hub's ``roberta-base`` folder loads as it
is (``load_hf_folder``; its masked-LM head and pooler are pretraining-only and skipped, the
classification head is initialised here for the task's classes).

Input rows are token ids (float in the shard store, exact below 2²⁴; cast here) padded with
``pad_token_id``, which masks attention and sets RoBERTa's position ids (padding index + 1
onwards, counting only real tokens). Post-norm layers, exact GELU, dropout as ``nn.Dropout``
modules only (the client code seeds torch's global generator per client and round for them;
``model.eval()`` turns them off). No BatchNorm, no buffers: ``functional_call`` and ``vmap``
(``randomness="different"`` in training mode) apply.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from models.attention import merge_heads, split_heads
from models.pretrained import check_config, load_checked, read_config, read_weights, weights_file


@dataclass(frozen=True)
class RobertaConfig:
    """Architecture hyperparameters under ``config.json``'s names (roberta-base's values)."""

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    @property
    def max_tokens(self) -> int:
        """Longest input: positions start after the padding index."""
        return self.max_position_embeddings - self.pad_token_id - 1


ROBERTA_BASE = RobertaConfig()


class Embeddings(nn.Module):
    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.pad_token_id = config.pad_token_id
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        positions = torch.cumsum(real.long(), dim=1) * real.long() + self.pad_token_id
        x = (
            self.word_embeddings(ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings.weight[0]  # one segment: token type 0 throughout
        )
        return self.dropout(self.LayerNorm(x))


class SelfAttention(nn.Module):
    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + key_bias
        return merge_heads(self.dropout(scores.softmax(dim=-1)) @ v)


class DenseResidualNorm(nn.Module):
    """``LayerNorm(residual + dropout(dense(x)))``: HF's ``RobertaSelfOutput``/``RobertaOutput``."""

    def __init__(self, config: RobertaConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(x)))


class Attention(nn.Module):
    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.self = SelfAttention(config)
        self.output = DenseResidualNorm(config, config.hidden_size)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, key_bias), x)


class Intermediate(nn.Module):
    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class Layer(nn.Module):
    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.attention = Attention(config)
        self.intermediate = Intermediate(config)
        self.output = DenseResidualNorm(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, key_bias)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, key_bias)
        return x


class RobertaModel(nn.Module):
    def __init__(self, config: RobertaConfig):
        super().__init__()
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)


class ClassificationHead(nn.Module):
    """HF's ``RobertaClassificationHead``: the ``<s>`` token → dense → tanh → classes."""

    def __init__(self, config: RobertaConfig, num_classes: int):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.out_proj = nn.Linear(config.hidden_size, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.dense(self.dropout(features[:, 0])))
        return self.out_proj(self.dropout(x))


class RobertaClassifier(nn.Module):
    """``forward`` maps (B, L) token ids to (B, num_classes) logits."""

    def __init__(self, config: RobertaConfig, num_classes: int):
        super().__init__()
        self.config = config
        self.roberta = RobertaModel(config)
        self.classifier = ClassificationHead(config, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """HF's ``_init_weights``: linear and embedding weights normal(0.02), biases 0,
        LayerNorm (1, 0); the padding embedding 0."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)
        with torch.no_grad():
            self.roberta.embeddings.word_embeddings.weight[self.config.pad_token_id].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x.long()
        real = ids != self.config.pad_token_id
        # Padding keys get the most negative float: softmax gives them weight 0.
        key_bias = (~real)[:, None, None, :] * torch.finfo(torch.float32).min
        hidden = self.roberta.encoder(self.roberta.embeddings(ids, real), key_bias)
        return self.classifier(hidden)


def build_roberta(config: RobertaConfig, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A RoBERTa classifier for rows of ``(L,)`` token ids, L at most ``config.max_tokens``."""
    if len(shape) != 1 or not 0 < shape[0] <= config.max_tokens:
        raise ValueError(
            f"RoBERTa takes rows of L token ids, 1 <= L <= {config.max_tokens}; got rows {shape}"
        )
    return RobertaClassifier(config, num_classes)


HEAD_PREFIXES = ("classifier.",)
# Pretraining-only tensors of the hub's roberta-base checkpoint (a RobertaForMaskedLM).
PRETRAINING_PREFIXES = ("lm_head.", "roberta.pooler.", "roberta.embeddings.position_ids")


def load_hf_folder(model: RobertaClassifier, folder: Path) -> None:
    """Initialise ``model`` from a Hugging Face folder (``config.json`` of ``model_type``
    roberta with the model's hyperparameters, weights in ``model.safetensors`` or
    ``pytorch_model.bin``). Keys without the ``roberta.`` prefix (a saved ``RobertaModel``)
    get it. The classification head stays the model's own, sized for the task."""
    expected = {"model_type": "roberta", "hidden_act": "gelu", **asdict(model.config)}
    check_config(folder / "config.json", read_config(folder), expected)
    path = weights_file(folder)
    state = read_weights(path)
    if not any(key.startswith("roberta.") for key in state):
        state = {f"roberta.{key}": value for key, value in state.items()}
    load_checked(model, path, state, HEAD_PREFIXES, PRETRAINING_PREFIXES)
