"""RoBERTa's tokenizer from a local folder: byte-level BPE on ``vocab.json`` + ``merges.txt``.

The same pipeline as ``transformers``' ``RobertaTokenizerFast`` (built on the ``tokenizers``
package): GPT-2's byte-level pre-tokenisation without an added prefix space, BPE merges,
``<s> A </s>`` for one text and ``<s> A </s></s> B </s>`` for a pair, the longest text truncated
first down to ``max_length`` tokens, then ``<pad>`` up to ``max_length``. The special tokens
(``<s>``, ``<pad>``, ``</s>``, ``<unk>``, ``<mask>`` where the vocabulary has them) are never split.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
CLS, SEP, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (CLS, PAD, SEP, "<unk>", "<mask>")


class TokenizerFilesError(FileNotFoundError):
    """A tokenizer folder without its files or with a vocabulary lacking RoBERTa's tokens."""

    def __init__(self, path: Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"tokenizer {path}: {problem}")

    def __reduce__(self):  # as Ray sends it from an actor: fields, then later state
        return (self.__class__, (self.path, self.problem), self.__dict__)


class RobertaTokenizer:
    """Encodes texts or text pairs to fixed-length rows of token ids."""

    def __init__(self, folder: Path):
        # Here, not at module level: every Ray actor imports the task table (and so this
        # module) at start, and only text tasks use the library (its import: ≈ 0.05 s of CPU
        # and an 11 MB shared library read from disk).
        from tokenizers import Tokenizer, models, pre_tokenizers, processors

        vocab_path, merges_path = folder / VOCAB_FILE, folder / MERGES_FILE
        for path in (vocab_path, merges_path):
            if not path.is_file():
                raise TokenizerFilesError(path, "missing (the Hugging Face tokenizer layout)")
        try:
            vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise TokenizerFilesError(vocab_path, f"unreadable ({error})") from None
        for token in (CLS, SEP, PAD):
            if token not in vocab:
                raise TokenizerFilesError(vocab_path, f"has no {token} token")
        self.vocab_size = len(vocab)
        self.pad_id = vocab[PAD]
        try:
            bpe = models.BPE.from_file(str(vocab_path), str(merges_path))
        except Exception as error:  # tokenizers raises plain Exception on a malformed file
            raise TokenizerFilesError(merges_path, f"unreadable ({error})") from None
        self._tokenizer = Tokenizer(bpe)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.post_processor = processors.RobertaProcessing(
            (SEP, vocab[SEP]), (CLS, vocab[CLS]), trim_offsets=True, add_prefix_space=False
        )
        self._tokenizer.add_special_tokens([t for t in SPECIAL_TOKENS if t in vocab])

    def encode(self, texts: list[str], pairs: list[str] | None, max_length: int) -> np.ndarray:
        """int64 ids (len(texts), max_length): each text (with its pair's text) encoded."""
        self._tokenizer.enable_truncation(max_length, strategy="longest_first")
        self._tokenizer.enable_padding(pad_id=self.pad_id, pad_token=PAD, length=max_length)
        inputs = texts if pairs is None else list(zip(texts, pairs, strict=True))
        encodings = self._tokenizer.encode_batch(inputs)
        return np.array([e.ids for e in encodings], dtype=np.int64).reshape(-1, max_length)
