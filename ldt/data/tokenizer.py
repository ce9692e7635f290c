"""Tokenizers, from local files only: ``bytes`` or a Hugging Face tokenizer on disk.

``data.tokenizer`` / ``ldt-preprocess --tokenizer`` is either ``bytes`` (a token per UTF-8
byte, vocabulary 256, end of document = 0 as megatron-core's byte-level tokenizer has it) or
the path of a Hugging Face tokenizer: a ``tokenizer.json`` file, or a folder holding one or
anything else ``transformers``' ``AutoTokenizer`` loads (e.g. the folder of an imported Hugging
Face checkpoint). Nothing is ever downloaded: a name that is not a local path (``gpt2``,
``meta-llama/...``) is refused before any library sees it, and the Hugging Face libraries run
with their offline switches set.

A ``tokenizer.json`` goes through the ``tokenizers`` library directly (fast, and it imports
neither torch nor ``transformers``, so the launcher checks a vocabulary in milliseconds);
``transformers`` is imported only for a folder without one. megatron-core's own
``MegatronTokenizer`` would import ``transformers`` (and torch) for every Hugging Face
tokenizer, and the dataset side of megatron-core needs only the ids :class:`TokenIds` holds.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from ldt.config import ConfigError
from ldt.config.userfiles import not_a

BYTES = "bytes"
BYTES_EOD = 0  # as megatron-core's ByteLevelTokenizer: NUL never occurs in text
# End-of-document tokens looked up in a tokenizer.json that comes without tokenizer_config.json
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


@dataclass(frozen=True)
class TokenizerSource:
    """Where a tokenizer comes from: ``kind`` is ``bytes``, ``json`` or ``folder``."""

    kind: str
    path: Optional[str] = None  # the tokenizer.json (kind json) or the folder (kind folder)
    config: Optional[str] = None  # a tokenizer_config.json next to the tokenizer.json, if any

    @property
    def name(self) -> str:
        return BYTES if self.kind == BYTES else str(self.path)


def resolve(spec: str, what: str = "data.tokenizer") -> TokenizerSource:
    """Where ``spec`` points, without loading anything; a non-local name is a ConfigError."""
    if spec == BYTES:
        return TokenizerSource(BYTES)
    path = os.path.abspath(os.path.expanduser(str(spec)))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return _json_source(os.path.join(path, "tokenizer.json"))
        return TokenizerSource("folder", path)
    if os.path.isfile(path):
        return _json_source(path)
    if os.path.exists(path):
        raise ConfigError(not_a(path, f"{what}={spec!r}", "file", "give the path of a "
                                "tokenizer.json or of a folder holding a Hugging Face tokenizer, "
                                "or 'bytes'"))
    raise ConfigError(
        f"{what}={spec!r} is not a local file or folder, and ldt never downloads tokenizers; "
        "give the path of a tokenizer.json or of a folder holding a Hugging Face tokenizer "
        "(fetch it once yourself, e.g. `huggingface-cli download NAME --local-dir DIR`), or "
        f"'{BYTES}'")


def _json_source(path: str) -> TokenizerSource:
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    return TokenizerSource("json", path, config if os.path.isfile(config) else None)


class Tokenizer:
    """Text -> token ids with the vocabulary size and the end-of-document id.

    ``encode`` adds no special tokens (no BOS); documents are plain text and ``ldt-preprocess``
    appends ``eod`` after each.
    """

    def __init__(self, source: TokenizerSource, eod_token: Optional[str] = None):
        self.source = source
        self._hf = None
        if source.kind == BYTES:
            self.vocab_size, self.eod = 256, BYTES_EOD
            if eod_token is not None:
                raise ConfigError(f"--eod-token={eod_token!r} with the bytes tokenizer: its end "
                                  f"of document is fixed ({BYTES_EOD}); leave --eod-token out")
            return
        # an audit event: the Rust library opens the file where Python's "open" event cannot
        # see it, and the communication audit must see a cloud rank building a tokenizer
        sys.audit("ldt.tokenizer.load", source.path)
        if source.kind == "json":
            self._load_json(source)
        else:
            self._load_folder(source)
        if eod_token is not None:
            self.eod = self.token_id(eod_token)
            if self.eod is None:
                raise ConfigError(f"--eod-token={eod_token!r} is not in the vocabulary of "
                                  f"{source.name}; give one of its tokens")

    @property
    def name(self) -> str:
        return self.source.name

    def _load_json(self, source: TokenizerSource) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._hf = HFTokenizer.from_file(source.path)
        except Exception as exc:  # the Rust library's errors are plain Exceptions
            raise ConfigError(f"tokenizer {source.path} cannot be loaded by the tokenizers "
                              f"library ({str(exc).splitlines()[0]}); give a Hugging Face "
                              "tokenizer.json (or its folder)") from None
        # a tokenizer.json saved after a call with truncation or padding keeps those settings,
        # which the library then applies to every document (transformers resets them per call)
        self._hf.no_truncation()
        self._hf.no_padding()
        vocab = self._hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._hf.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        eos = _config_eos(source.config) if source.config else None
        names = (eos,) if eos else EOD_NAMES
        self.eod = next((vocab[n] for n in names if n in vocab), None)

    def _load_folder(self, source: TokenizerSource) -> None:
        _offline()
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError(f"tokenizer folder {source.path} has no tokenizer.json, and "
                              "loading it needs transformers: `pip install transformers`, or "
                              "give a tokenizer.json") from None

        try:
            self._hf = AutoTokenizer.from_pretrained(source.path, local_files_only=True)
        except Exception as exc:
            raise ConfigError(f"folder {source.path} holds no tokenizer transformers' "
                              f"AutoTokenizer can load offline ({str(exc).splitlines()[0]}); "
                              "give a folder with tokenizer.json (or tokenizer_config.json and "
                              "its vocabulary files)") from None
        self.vocab_size = len(self._hf)
        self.eod = self._hf.eos_token_id

    def token_id(self, token: str) -> Optional[int]:
        if self.source.kind == "json":
            return self._hf.token_to_id(token)
        if self.source.kind == "folder":
            ids = self._hf.convert_tokens_to_ids([token])
            return None if not ids or ids[0] == self._hf.unk_token_id else ids[0]
        return None

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (a batch: the Rust tokenizer parallelises nothing here)."""
        if self.source.kind == BYTES:
            return [list(t.encode("utf-8")) for t in texts]
        if self.source.kind == "json":
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        return self._hf(texts, add_special_tokens=False)["input_ids"]


def load(spec: str, what: str = "data.tokenizer", eod_token: Optional[str] = None) -> Tokenizer:
    return Tokenizer(resolve(spec, what), eod_token)


@dataclass(frozen=True)
class TokenIds:
    """What megatron-core's ``GPTDatasetConfig`` asks of a tokenizer: ids, not the tokenizer.

    ``GPTDataset`` reads ``vocab_size`` (dtype code), ``eod`` and ``pad`` (masks) and
    ``unique_identifiers`` (its index-cache key). :meth:`withheld` is what the cloud ranks get:
    no vocabulary, nothing that could encode or decode anything.
    """

    vocab_size: Optional[int]
    eod: Optional[int]
    source: str
    pad: int = -1  # megatron-core's own "no pad token" id: never in the data
    unique_identifiers: dict = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, tok: Tokenizer) -> "TokenIds":
        ids = {"class": "ldt.data.tokenizer.TokenIds", "tokenizer": tok.name,
               "vocab_size": tok.vocab_size, "eod": tok.eod}
        return cls(tok.vocab_size, tok.eod, tok.name, unique_identifiers=ids)

    @classmethod
    def withheld(cls) -> "TokenIds":
        return cls(None, None, "withheld", unique_identifiers={"class": "withheld"})


def _config_eos(path: str) -> Optional[str]:
    """``eos_token`` of a tokenizer_config.json (a string or an AddedToken dict)."""
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def _offline() -> None:
    """The Hugging Face libraries' own switches: never reach the hub, whatever is cached."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
