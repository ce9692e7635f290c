"""What the documents assume a reader already has, made offline for the doc test.

A command in a document may name a file the reader brings (``path/to/hf_model``, a tokenizer in
``tok/``, ``corpus.txt``, ...). :data:`FIXTURES` maps each such path to a function that makes a
small one in the scratch folder, so the command runs as written; a fixture is made only for a
document that names its path. Nothing is downloaded: the model is a random tiny Llama written
with ``transformers``, the tokenizer a byte-level BPE trained here with ``tokenizers``
(``tests/data_corpus.py``).
"""

from __future__ import annotations

import json
import os

from data_corpus import sources, train_tokenizer, write_text


def tokenizer(root: str) -> None:
    """``tok/tokenizer.json``: a byte-level BPE of 300 tokens (the docs' vocab 320 fits it)."""
    train_tokenizer(os.path.join(root, "tok"), sources(0, 20))


def hf_model(root: str) -> None:
    """``path/to/hf_model``: a random tiny ``LlamaForCausalLM`` (4 layers, hidden 64, 4 heads /
    2 KV groups: fits cpu_vtp's TP 2/1/2) with a tokenizer, saved as safetensors."""
    import torch
    import transformers

    folder = os.path.join(root, "path", "to", "hf_model")
    tok_json = train_tokenizer(os.path.join(folder, "bpe"), sources(0, 20))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tok_json,
                                                  eos_token="<|endoftext|>")
    config = transformers.LlamaConfig(vocab_size=len(hf_tok), hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    for name in os.listdir(os.path.join(folder, "bpe")):
        os.remove(os.path.join(folder, "bpe", name))
    os.rmdir(os.path.join(folder, "bpe"))


def texts(*names: str):
    """Plain text files of Python source (a few hundred KB each)."""
    def make(root: str) -> None:
        for k, name in enumerate(names):
            write_text(os.path.join(root, name), first=8 * k, count=8)
    return make


def jsonl(name: str):
    """A JSONL file, one ``{"text": ...}`` document per Python source file."""
    def make(root: str) -> None:
        with open(os.path.join(root, name), "w") as f:
            for doc in sources(40, 40):
                f.write(json.dumps({"text": doc}) + "\n")
    return make


# path a document names -> how to make it (in the scratch folder, before the first command)
FIXTURES = {
    "path/to/hf_model": hf_model,
    "HF_FOLDER": hf_model,  # docs/models.md's placeholder, filled with path/to/hf_model
    "tok/": tokenizer,
    "corpus.txt": texts("corpus.txt"),
    "a.txt": texts("a.txt"),
    "b.jsonl": jsonl("b.jsonl"),
    "my_public_corpus.txt": texts("my_public_corpus.txt"),
}
