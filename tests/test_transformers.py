"""DP-FedPGN's transformers: ViT-B/16 (timm keys) and RoBERTa-base (Hugging Face keys), their
pretrained-folder loader, the RoBERTa tokenizer and the GLUE readers, on tiny randomly
initialised models of the same architecture and small files in the exact on-disk formats."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_local
from torch.func import functional_call, grad, vmap

from cluster.claims.calibration import calibrated
from cluster.config import ConfigError, load_config
from datasets.glue import GLUE_TASKS, GlueFormatError, load_glue, read_glue_tsv
from datasets.tasks import TASKS, Task
from datasets.tokenizer import RobertaTokenizer
from models import MODELS, PRETRAINED_LOADERS
from models.pretrained import PretrainedError, read_safetensors
from models.roberta import RobertaClassifier, RobertaConfig, load_hf_folder
from models.vit import VisionTransformer, ViTConfig, load_timm_folder

TINY_VIT = ViTConfig(
    architecture="vit_tiny_test", image_size=16, patch_size=8, dim=16, depth=2, num_heads=2,
    mlp_dim=32,
)  # fmt: skip
TINY_ROBERTA = RobertaConfig(
    vocab_size=24, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=32, max_position_embeddings=18,
)  # fmt: skip
# A byte-level BPE vocabulary: "Ġ" is the byte-level character of the space.
VOCAB = {
    "<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "h": 4, "e": 5, "l": 6, "o": 7, "Ġ": 8,
    "w": 9, "r": 10, "d": 11, "he": 12, "ll": 13, "hell": 14, "hello": 15, "Ġw": 16, "!": 17,
    "a": 18, "b": 19,
}  # fmt: skip
MERGES = "#version: 0.2\nh e\nl l\nhe ll\nhell o\nĠ w\n"


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors layout: u64 LE header length, JSON header (padded with spaces to 8
    bytes), then each float32 tensor's little-endian bytes."""
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().contiguous().to(torch.float32).numpy().astype("<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def write_tokenizer(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(VOCAB))
    (folder / "merges.txt").write_text(MERGES)


def roberta_folder(folder: Path, state: dict, fmt: str = "safetensors") -> Path:
    """A Hugging Face roberta folder for TINY_ROBERTA holding ``state``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "roberta",
        "architectures": ["RobertaForMaskedLM"],
        "hidden_act": "gelu",
        **{k: getattr(TINY_ROBERTA, k) for k in TINY_ROBERTA.__dataclass_fields__},
    }
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        write_safetensors(folder / "model.safetensors", state)
    else:
        torch.save(state, folder / "pytorch_model.bin")
    write_tokenizer(folder)
    return folder


def pretraining_state(model: RobertaClassifier) -> dict:
    """The model's encoder as the hub's roberta-base stores it: a masked-LM checkpoint (lm_head
    and pooler, which the classifier does not use; no classification head)."""
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("classifier.")}
    hidden = TINY_ROBERTA.hidden_size
    state["lm_head.dense.weight"] = torch.randn(hidden, hidden)
    state["lm_head.bias"] = torch.randn(TINY_ROBERTA.vocab_size)
    state["roberta.pooler.dense.weight"] = torch.randn(hidden, hidden)
    return state


# ----------------------------------------------------------------------------- models


def test_full_size_models_have_the_checkpoints_names_and_sizes():
    with torch.device("meta"):
        vit = MODELS["vit_b16"]((3, 32, 32), 10)
        roberta = MODELS["roberta_base"]((128,), 2)
    vit_shapes = {k: tuple(v.shape) for k, v in vit.state_dict().items()}
    assert vit_shapes["pos_embed"] == (1, 197, 768)
    assert vit_shapes["patch_embed.proj.weight"] == (768, 3, 16, 16)
    assert vit_shapes["blocks.11.attn.qkv.weight"] == (2304, 768)
    assert vit_shapes["blocks.11.mlp.fc1.weight"] == (3072, 768)
    assert vit_shapes["head.weight"] == (10, 768)
    # timm's vit_base_patch16_224 has 86,567,656 parameters with its 1000-class head
    assert sum(v.numel() for v in vit.parameters()) == 86_567_656 - 990 * 769
    rob_shapes = {k: tuple(v.shape) for k, v in roberta.state_dict().items()}
    assert rob_shapes["roberta.embeddings.word_embeddings.weight"] == (50265, 768)
    assert rob_shapes["roberta.embeddings.position_embeddings.weight"] == (514, 768)
    assert rob_shapes["roberta.encoder.layer.11.attention.self.query.weight"] == (768, 768)
    assert rob_shapes["roberta.encoder.layer.11.output.LayerNorm.bias"] == (768,)
    assert rob_shapes["classifier.out_proj.weight"] == (2, 768)
    # transformers' RobertaForSequenceClassification(roberta-base, 2 labels)
    assert sum(v.numel() for v in roberta.parameters()) == 124_647_170
    assert not list(vit.buffers()) and not list(roberta.buffers())


def test_tiny_vit_resizes_and_vmaps():
    torch.manual_seed(0)
    model = VisionTransformer(TINY_VIT, 3)
    x = torch.randn(4, 3, 8, 8)  # resized to 16×16 inside
    assert model(x).shape == (4, 3)
    resized = torch.nn.functional.interpolate(x, size=(16, 16), mode="bilinear")
    torch.testing.assert_close(model(x), model(resized))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xb[None],)), yb[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, torch.tensor([0, 1, 2, 0]))
    direct = grad(loss)(params, x[1], torch.tensor(1))
    torch.testing.assert_close(per_sample["pos_embed"][1], direct["pos_embed"])


def test_tiny_roberta_ignores_padding_and_vmaps():
    torch.manual_seed(0)
    model = RobertaClassifier(TINY_ROBERTA, 2).eval()
    ids = torch.tensor([[0, 5, 6, 2, 1, 1], [0, 7, 2, 1, 1, 1]], dtype=torch.float32)
    logits = model(ids)
    assert logits.shape == (2, 2)
    more_padding = torch.cat([ids, torch.ones(2, 4)], dim=1)
    torch.testing.assert_close(model(more_padding), logits)
    assert not torch.allclose(model(ids[:, [0, 2, 1, 3, 4, 5]]), logits)  # order matters
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xb[None],)), yb[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, ids, torch.tensor([0, 1]))
    assert per_sample["classifier.out_proj.weight"].shape == (2, 2, 16)
    model.train()  # dropout: nn.Dropout modules only, so the client code can seed them
    torch.manual_seed(1)
    first = model(ids)
    torch.manual_seed(1)
    torch.testing.assert_close(model(ids), first)
    assert not torch.allclose(model(ids), first)


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_roberta_round_trip_keeps_its_own_head(tmp_path, fmt):
    torch.manual_seed(0)
    source = RobertaClassifier(TINY_ROBERTA, 2)
    folder = roberta_folder(tmp_path / "rob", pretraining_state(source), fmt)
    torch.manual_seed(1)
    target = RobertaClassifier(TINY_ROBERTA, 3)
    head = target.classifier.out_proj.weight.clone()
    load_hf_folder(target, folder)
    for key, value in source.state_dict().items():
        if not key.startswith("classifier."):
            torch.testing.assert_close(target.state_dict()[key], value, rtol=0, atol=0)
    torch.testing.assert_close(target.classifier.out_proj.weight, head, rtol=0, atol=0)


def test_roberta_model_checkpoint_without_prefix_loads(tmp_path):
    source = RobertaClassifier(TINY_ROBERTA, 2)
    state = {
        k.removeprefix("roberta."): v
        for k, v in source.state_dict().items()
        if "classifier" not in k
    }
    target = RobertaClassifier(TINY_ROBERTA, 2)
    load_hf_folder(target, roberta_folder(tmp_path / "rob", state))
    torch.testing.assert_close(target.roberta.embeddings.word_embeddings.weight,
                               source.roberta.embeddings.word_embeddings.weight)  # fmt: skip


def _refusal(tmp_path, state: dict, config_change: dict | None = None) -> str:
    folder = roberta_folder(tmp_path / "bad", state)
    if config_change:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_change}))
    with pytest.raises(PretrainedError) as error:
        load_hf_folder(RobertaClassifier(TINY_ROBERTA, 2), folder)
    return str(error.value)


def test_roberta_loader_refuses_mismatches(tmp_path):
    state = pretraining_state(RobertaClassifier(TINY_ROBERTA, 2))
    key = "roberta.encoder.layer.1.attention.self.query.weight"
    renamed = {("roberta.encoder.layer.1.attention.self.q.weight" if k == key else k): v
               for k, v in state.items()}  # fmt: skip
    message = _refusal(tmp_path, renamed)
    assert "unknown key" in message and "attention.self.q.weight" in message
    assert "model.safetensors" in message
    missing = {k: v for k, v in state.items() if k != key}
    assert key in _refusal(tmp_path, missing)
    wrong_shape = {**state, key: torch.zeros(16, 8)}
    assert "(16, 8)" in _refusal(tmp_path, wrong_shape)
    assert "num_hidden_layers" in _refusal(tmp_path, state, {"num_hidden_layers": 12})
    folder = roberta_folder(tmp_path / "bad", state)
    config = (folder / "config.json").read_text()
    (folder / "config.json").unlink()
    with pytest.raises(PretrainedError, match="config.json"):
        load_hf_folder(RobertaClassifier(TINY_ROBERTA, 2), folder)
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").unlink()
    with pytest.raises(PretrainedError, match="pytorch_model.bin"):
        load_hf_folder(RobertaClassifier(TINY_ROBERTA, 2), tmp_path / "bad")


def test_vit_round_trip_and_refusals(tmp_path):
    torch.manual_seed(0)
    source = VisionTransformer(TINY_VIT, 21843)  # an in21k checkpoint's head
    folder = tmp_path / "vit"
    folder.mkdir()
    config = {"architecture": "vit_tiny_test", "num_classes": 21843, "num_features": 16}
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(source.state_dict(), folder / "pytorch_model.bin")
    target = VisionTransformer(TINY_VIT, 10)
    load_timm_folder(target, folder)
    torch.testing.assert_close(target.pos_embed, source.pos_embed, rtol=0, atol=0)
    torch.testing.assert_close(target.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)
    assert target.head.weight.shape == (10, 16)
    state = {**source.state_dict(), "pre_logits.fc.weight": torch.zeros(16, 16)}
    write_safetensors(folder / "model.safetensors", state)  # read before the .bin
    with pytest.raises(PretrainedError, match="pre_logits.fc.weight"):
        load_timm_folder(target, folder)
    (folder / "config.json").write_text(json.dumps({**config, "architecture": "vit_large"}))
    with pytest.raises(PretrainedError, match="vit_large"):
        load_timm_folder(target, folder)


def test_safetensors_reader_checks_byte_ranges(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": torch.arange(6.0).reshape(2, 3)})
    torch.testing.assert_close(read_safetensors(path)["a"], torch.arange(6.0).reshape(2, 3))
    data = path.read_bytes()
    path.write_bytes(data[:-4])  # truncated: the last float is gone
    with pytest.raises(PretrainedError, match="end at byte 24, the body at 20"):
        read_safetensors(path)
    path.write_bytes(struct.pack("<Q", 10**6) + data[8:])
    with pytest.raises(PretrainedError, match="too large for the file"):
        read_safetensors(path)


def _raw_safetensors(path: Path, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def test_safetensors_reader_refuses_shared_gapped_or_malformed_ranges(tmp_path):
    """Many entries on one byte range would copy the file many times over: refused before any
    tensor is built, as are gaps, a byte count that does not fit the shape, and bad shapes."""
    path = tmp_path / "w.safetensors"
    shared = {f"t{i}": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]} for i in range(50)}
    _raw_safetensors(path, shared, bytes(16))
    with pytest.raises(PretrainedError, match="starts at byte 0, expected 16"):
        read_safetensors(path)
    gap = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
    _raw_safetensors(path, gap, bytes(8))
    with pytest.raises(PretrainedError, match="starts at byte 4, expected 0"):
        read_safetensors(path)
    for shape in ([True, 4], [2.0, 2], [-1, -4], [2**62, 0]):
        bad = {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}
        _raw_safetensors(path, bad, bytes(16))
        with pytest.raises(PretrainedError, match="malformed header entry|do not hold"):
            read_safetensors(path)
    empty = {"a": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}}
    _raw_safetensors(path, empty, b"")
    assert read_safetensors(path)["a"].shape == (0, 3)


# ----------------------------------------------------------------------------- text data


def test_tokenizer_hand_worked_bpe(tmp_path):
    write_tokenizer(tmp_path)
    tokenizer = RobertaTokenizer(tmp_path)
    # "hello" merges h·e, l·l, he·ll, hell·o; " world" is "Ġw" (merge Ġ·w) o r l d
    assert tokenizer.encode(["hello world!"], None, 12).tolist() == [
        [0, 15, 16, 7, 10, 6, 11, 17, 2, 1, 1, 1]
    ]
    # pairs: <s> A </s></s> B </s>; the longer text is truncated first to fit 9 ids
    pairs = tokenizer.encode(["hello", "he"], ["world", "hello hello hello"], 9).tolist()
    assert pairs == [[0, 15, 2, 2, 9, 7, 10, 6, 2], [0, 12, 2, 2, 15, 8, 15, 8, 2]]


GLUE_FILES = {
    "sst2": ("sentence\tlabel", ["a b\t1", "hello\t0"]),
    "qqp": (
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
        ["7\t1\t2\thello\tworld\t1", "8\t3\t4\ta\tb\t0"],
    ),
    "mrpc": (
        "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
        ["1\t11\t12\thello\tworld", "0\t13\t14\tb\ta"],
    ),
    "qnli": (
        "index\tquestion\tsentence\tlabel",
        ["0\thello\tworld\tnot_entailment", "1\ta\tb\tentailment"],
    ),
}


def write_glue(root: Path, name: str, rows: int = 2) -> None:
    header, lines = GLUE_FILES[name]
    folder = root / GLUE_TASKS[name].folder
    folder.mkdir(parents=True, exist_ok=True)
    body = "".join(f"{lines[i % len(lines)]}\n" for i in range(rows))
    for split in ("train.tsv", "dev.tsv"):
        (folder / split).write_text(f"{header}\n{body}", encoding="utf-8")


@pytest.mark.parametrize("name", sorted(GLUE_FILES))
def test_glue_reader_exact_layout(tmp_path, name):
    write_glue(tmp_path, name)
    path = tmp_path / GLUE_TASKS[name].folder / "train.tsv"
    texts, pairs, labels = read_glue_tsv(GLUE_TASKS[name], path)
    expected = {
        "sst2": (["a b", "hello"], None, [1, 0]),
        "qqp": (["hello", "a"], ["world", "b"], [1, 0]),
        "mrpc": (["hello", "b"], ["world", "a"], [1, 0]),
        "qnli": (["hello", "a"], ["world", "b"], [1, 0]),
    }[name]
    assert (texts, pairs, labels.tolist()) == expected
    write_tokenizer(tmp_path / "tok")
    train, test = load_glue(name, tmp_path, "tok", max_length=8)
    assert train.x.shape == (2, 8) and train.x.dtype == np.float32
    assert train.x[0, 0] == 0 and train.x[0, 1] == (15 if texts[0] == "hello" else 18)


def test_glue_reader_refuses_bad_rows(tmp_path):
    write_glue(tmp_path, "qnli")
    path = tmp_path / "QNLI" / "train.tsv"
    path.write_text(path.read_text() + "2\tq\ts\tcontradiction\n")
    with pytest.raises(GlueFormatError, match="line 4: label 'contradiction'"):
        read_glue_tsv(GLUE_TASKS["qnli"], path)
    path.write_text("question\tsentence\tlabel\n")
    with pytest.raises(GlueFormatError, match="header"):
        read_glue_tsv(GLUE_TASKS["qnli"], path)
    with pytest.raises(ValueError, match="'..'"):
        load_glue("qnli", tmp_path, "../tok")


# ----------------------------------------------------------------------------- config, run


def _sst2_overrides(tmp_path: Path, store_root: Path) -> list[str]:
    return [
        "task=sst2_roberta_tiny",
        "data.source=sst2",
        f"data.root={tmp_path / 'raw'}",
        "data.pretrained=roberta-tiny",
        "data.max_length=8",
        f"data.store_root={store_root}",
        "data.num_clients=4",
        "data.partition.method=iid",
        "cohort.size=2",
        "rounds=2",
        "algorithm.name=dp_fedpgn",
        "algorithm.clip_norm=1.0",
        "algorithm.noise_multiplier=0.8",
        "algorithm.local.batch_size=2",
        "algorithm.local.local_steps=2",
        "executor.kind=local",
        "tracking.enabled=false",
    ]


@pytest.fixture
def tiny_roberta_task(monkeypatch):
    """``sst2_roberta_tiny``: the sst2 task on TINY_ROBERTA (registered for this test only)."""
    monkeypatch.setitem(MODELS, "roberta_tiny", lambda shape, k: RobertaClassifier(TINY_ROBERTA, k))
    monkeypatch.setitem(PRETRAINED_LOADERS, "roberta_tiny", load_hf_folder)
    monkeypatch.setitem(
        TASKS, "sst2_roberta_tiny", Task("sst2_roberta_tiny", ("sst2",), "roberta_tiny")
    )


def test_config_checks_pretrained_and_max_length(tmp_path, store_root, tiny_roberta_task):
    base = _sst2_overrides(tmp_path, store_root)
    for bad, field in [
        ("data.pretrained=../roberta", "data.pretrained"),
        ("data.pretrained=/models/roberta", "data.pretrained"),
        ("data.pretrained=null", "data.pretrained"),
        ("data.max_length=1000", "data.max_length"),
    ]:
        with pytest.raises(ConfigError) as error:
            load_config(None, [*base, bad])
        assert error.value.field_path == field
    with pytest.raises(ConfigError, match="loads no pretrained weights"):
        load_config(None, ["task=cifar10_resnet10", "data.source=cifar10", "data.pretrained=x"])
    with pytest.raises(ConfigError, match="data.max_length"):
        load_config(None, ["task=cifar10_resnet10", "data.source=cifar10", "data.max_length=8"])


def test_tiny_roberta_federated_rounds_from_pretrained(tmp_path, store_root, tiny_roberta_task):
    write_glue(tmp_path / "raw", "sst2", rows=12)
    torch.manual_seed(0)
    pretrained = RobertaClassifier(TINY_ROBERTA, 2)
    roberta_folder(tmp_path / "raw" / "roberta-tiny", pretraining_state(pretrained))
    config = calibrated(load_config(None, _sst2_overrides(tmp_path, store_root)))
    sim = run_local(config)
    assert len(sim.history) == 2 and torch.isfinite(sim.state.params).all()
    assert all(r.test_accuracy is not None for r in sim.history)
    # round 0 started from the pretrained encoder: the initial model held its weights
    from cluster.runtime.initial_state import initial_model

    model, _ = initial_model(config, (8,), 2)
    torch.testing.assert_close(
        model.roberta.encoder.layer[1].output.dense.weight,
        pretrained.roberta.encoder.layer[1].output.dense.weight,
    )


# ----------------------------------------------------------------------------- paper configs

TRANSFORMER_CONFIGS = sorted(
    str(p)
    for p in Path("configs/papers").glob("dpfedpgn_*.yaml")
    if "_vit_" in p.name or "_roberta_" in p.name
)


@pytest.mark.parametrize("path", TRANSFORMER_CONFIGS, ids=lambda p: Path(p).stem)
def test_transformer_paper_configs_hold_table_v(path):
    config = load_config(path)
    local = config.algorithm.local
    assert len(TRANSFORMER_CONFIGS) == 6
    assert (config.rounds, config.data.partition.alpha, local.batch_size) == (100, 0.1, 16)
    assert (local.lr, local.lr_decay) == (pytest.approx(0.098), 0.98)
    assert config.algorithm.name == "dp_fedpgn" and config.data.pretrained is not None
    assert config.task.endswith("_vit_b16" if "_vit_" in path else "_roberta_base")


def test_sst2_paper_config_runs_shrunk(tmp_path, store_root, monkeypatch):
    """The SST-2 config as written, shrunk in scale, TINY_ROBERTA standing in for roberta-base."""
    monkeypatch.setitem(MODELS, "roberta_base", lambda shape, k: RobertaClassifier(TINY_ROBERTA, k))
    raw = tmp_path / "raw"
    write_glue(raw, "sst2", rows=12)
    roberta_folder(raw / "roberta-base", pretraining_state(RobertaClassifier(TINY_ROBERTA, 2)))
    overrides = [
        f"data.root={raw}",
        f"data.store_root={store_root}",
        f"checkpoint.dir={tmp_path / 'ck'}",
        "data.max_length=8",
        "data.num_clients=4",
        "cohort.size=2",
        "rounds=2",
        "eval_every=1",
        "algorithm.local.batch_size=2",
        "algorithm.local.local_steps=1",
        "executor.kind=local",
        "executor.num_actors=1",
        "executor.gpus_per_actor=0",
        "tracking.enabled=false",
    ]
    config = calibrated(load_config("configs/papers/dpfedpgn_roberta_sst2.yaml", overrides))
    sim = run_local(config)
    assert len(sim.history) == 2 and torch.isfinite(sim.state.params).all()
    assert sim.history[-1].epsilon is not None and sim.history[-1].epsilon > 0
