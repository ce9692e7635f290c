"""A tiny random Llama written as a GGUF file the way llama.cpp writes SmolLM2's: the stand-in
that lets ``examples/finetune_smollm2.py`` run in the suite without its 93 MB download.

transformers builds the model (random weights, 6 heads / 3 KV heads so a stage of TP 3 splits
it as SmolLM2's 9 / 3, tied embeddings as SmolLM2's); the ``gguf`` package writes it under
llama.cpp's names, with the query and key rows permuted as llama.cpp's converter does (and
transformers undoes on reading), and a byte-level tokenizer (256 byte tokens, no merges, an
end-of-text token). Everything is made here, offline.
"""

from __future__ import annotations

import os

import numpy as np
import torch

VOCAB = 257  # 256 bytes + <|endoftext|>


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its convert_hf_to_gguf.py ``permute``)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def write_tiny_llama(folder: str, name: str = "tiny-llama.gguf", layers: int = 3):
    """Write the GGUF file into ``folder``; returns (its path, the transformers model)."""
    import gguf
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    path = os.path.join(folder, name)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    byte_chars = bytes_to_unicode()
    w.add_token_list([byte_chars[b] for b in range(256)] + ["<|endoftext|>"])
    w.add_token_types([1] * 256 + [3])  # normal, then control
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(VOCAB - 1)
    w.add_eos_token_id(VOCAB - 1)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}  # no output.weight: tied
    for i in range(layers):
        hf, g = f"model.layers.{i}.", f"blk.{i}."
        names.update({hf + "self_attn.q_proj.weight": g + "attn_q.weight",
                      hf + "self_attn.k_proj.weight": g + "attn_k.weight",
                      hf + "self_attn.v_proj.weight": g + "attn_v.weight",
                      hf + "self_attn.o_proj.weight": g + "attn_output.weight",
                      hf + "mlp.gate_proj.weight": g + "ffn_gate.weight",
                      hf + "mlp.up_proj.weight": g + "ffn_up.weight",
                      hf + "mlp.down_proj.weight": g + "ffn_down.weight",
                      hf + "input_layernorm.weight": g + "attn_norm.weight",
                      hf + "post_attention_layernorm.weight": g + "ffn_norm.weight"})
    for hf_name, gguf_name in names.items():
        t = weights[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            t = _permute(t, config.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            t = _permute(t, config.num_key_value_heads)
        w.add_tensor(gguf_name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model
