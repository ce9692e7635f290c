"""Model families end to end: ``ldt-train model=llama_tiny / qwen2_tiny`` on a U-shape and a
VTP pipeline with ``train.verify`` parity, a fine-tune from an imported Hugging Face model
(first loss = transformers' loss on the same batches), checkpoints refused before any
collective, and the small rules (vocabulary padding, layer-spec choice, canonical names).
"""

import json
import subprocess
import sys

import pytest
import torch

from ldt.config import ConfigError, ModelConfig, to_model

PARITY = 1e-5


def ldt_train(run_dir, *overrides, timeout=300, ok=True):
    proc = subprocess.run([sys.executable, "-m", "ldt.train", f"run_dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=timeout)
    if not ok:
        return proc
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the small rules -------------------------------------------------------------------------

def test_vocab_padding_is_megatrons_rule_for_every_stage():
    from ldt.models.vocab import fit_rows, padded_vocab_size

    assert padded_vocab_size(32000, [8]) == 32768  # Megatron: multiple of 128 * tp
    assert padded_vocab_size(32000, [1]) == 32000
    assert padded_vocab_size(128256, [2]) == 128256
    assert padded_vocab_size(250, [1, 2]) == 256
    assert padded_vocab_size(49152, [3]) == 49152  # SmolLM2 on a TP 3 stage: no padding
    assert padded_vocab_size(1000, [2, 3], 1) == 1002  # every stage's TP divides it
    t = torch.arange(6.0).reshape(3, 2)
    assert fit_rows("output_layer.weight", t, 5).tolist()[3:] == [[0, 0], [0, 0]]
    assert torch.equal(fit_rows("output_layer.weight", fit_rows("x", t, 5), 3), t)
    with pytest.raises(ValueError, match="vocabulary of 3"):
        fit_rows("output_layer.weight", t, 2, vocab_size=3)


def test_mtp_spec_is_megatrons_for_the_last_stage(monkeypatch):
    """ldt builds the MTP block spec itself (megatron's builder asks parallel_state whether
    this is the last pipeline stage, which a U-shape's edge is not); it must be the spec
    megatron-core's get_gpt_mtp_block_spec gives the last stage of a one-stage model."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)

    from ldt.models.build import _mtp_block_spec, transformer_config
    from ldt.models.spec import LOCAL

    model = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, mtp_num_layers=3)
    config = transformer_config(model, 1, 2, mtp_num_layers=3)
    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", lambda *a, **k: True)
    layer = get_gpt_layer_local_spec()
    assert _mtp_block_spec(layer, 3, LOCAL) == get_gpt_mtp_block_spec(
        config, layer, use_transformer_engine=False)


def test_layer_spec_choice():
    from ldt.models.spec import LOCAL, TE, transformer_impl

    auto = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert transformer_impl(auto, "cuda", te_available=True) == TE
    assert transformer_impl(auto, "cuda", te_available=False) == LOCAL
    assert transformer_impl(auto, "cpu", te_available=True) == LOCAL
    assert transformer_impl(auto, "npu", te_available=True) == LOCAL
    forced = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                         transformer_impl="transformer_engine")
    assert transformer_impl(forced, "cuda", te_available=True) == TE
    with pytest.raises(ConfigError, match="model.transformer_impl=transformer_engine on a cpu"):
        transformer_impl(forced, "cpu", te_available=True)
    with pytest.raises(ConfigError, match="not installed"):
        transformer_impl(forced, "cuda", te_available=False)


def test_one_canonical_name_for_local_and_transformer_engine_parameters():
    from ldt.models.spec import canonical_name

    te = {"decoder.layers.3.self_attention.linear_qkv.layer_norm_weight":
          "decoder.layers.3.input_layernorm.weight",
          "decoder.layers.3.self_attention.linear_qkv.layer_norm_bias":
          "decoder.layers.3.input_layernorm.bias",
          "decoder.layers.0.mlp.linear_fc1.layer_norm_weight":
          "decoder.layers.0.pre_mlp_layernorm.weight"}
    for name, want in te.items():
        assert canonical_name(name) == want
    for same in ("decoder.layers.3.input_layernorm.weight", "decoder.final_layernorm.weight",
                 "decoder.layers.1.mlp.linear_fc1.weight"):
        assert canonical_name(same) == same


def test_model_config_refuses_what_cannot_work():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8)
    with pytest.raises(ConfigError, match="model.activation=swiglu.*gated_linear_unit=true"):
        to_model({**base, "activation": "swiglu"})
    with pytest.raises(ConfigError, match="model.normalization='rmsnorm'"):
        to_model({**base, "normalization": "rmsnorm"})
    with pytest.raises(ConfigError, match="model.num_query_groups=3 does not divide"):
        to_model({**base, "num_query_groups": 3})


def test_qkv_fusion_round_trips_and_groups_per_query_group():
    from ldt.models.hf.families import fuse_qkv, split_qkv

    heads, groups, d, h = 8, 2, 3, 5
    q, k, v = (torch.randn(n * d, h) for n in (heads, groups, groups))
    fused = fuse_qkv(q, k, v, heads, groups)
    # group 0: its 4 query heads, then k_0, then v_0 (megatron's get_query_key_value_tensors)
    assert torch.equal(fused[:4 * d], q[:4 * d])
    assert torch.equal(fused[4 * d:5 * d], k[:d]) and torch.equal(fused[5 * d:6 * d], v[:d])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, groups), (q, k, v)))


# ---- ldt-train on the new families ---------------------------------------------------------

def _qwen2_tiny_from_transformers(folder):
    """A random Qwen2ForCausalLM with exactly conf/model/qwen2_tiny.yaml's architecture."""
    import transformers

    from ldt.hydra_app import compose

    m = to_model(compose(["model=qwen2_tiny"]).model)
    cfg = transformers.Qwen2Config(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, rope_theta=m.rotary_base,
        rms_norm_eps=m.norm_epsilon, max_position_embeddings=m.seq_length,
        tie_word_embeddings=False)
    torch.manual_seed(11)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return model, m


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from ldt.models.hf import import_hf

    root = tmp_path_factory.mktemp("qwen")
    model, cfg = _qwen2_tiny_from_transformers(root / "hf")
    import_hf(str(root / "hf"), str(root / "ldt"), log=lambda *_: None)
    return model, cfg, root / "ldt"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model,cluster", [("llama_tiny", "cpu_demo"), ("llama_tiny", "cpu_vtp"),
                                           ("qwen2_tiny", "cpu_demo")])
def test_families_train_with_verify_parity(tmp_path, model, cluster):
    summary = ldt_train(tmp_path, f"model={model}", f"cluster={cluster}", "train.steps=4",
                        "train.verify=true")
    assert summary["parity_max_abs_diff"] < PARITY, summary
    assert summary["final_loss"] < summary["first_loss"]


@pytest.mark.timeout(400)
def test_finetune_from_an_imported_checkpoint(tmp_path, imported):
    """qwen2_tiny on cpu_vtp (TP 2/1/2) from a transformers model: step 0's loss is
    transformers' own loss on the same batches; verify parity holds; the run's checkpoint
    exports back to a folder transformers loads."""
    import transformers

    from ldt.data.bytes import TextData
    from ldt.models.hf import export_hf

    hf_model, cfg, ckpt = imported
    summary = ldt_train(tmp_path / "run", "model=qwen2_tiny", "cluster=cpu_vtp",
                        f"train.load={ckpt}", "train.steps=4", "train.save_every=4",
                        "train.verify=true")
    assert summary["parity_max_abs_diff"] < PARITY, summary
    data = TextData(None, cfg.seq_length, 2, 4, seed=1234, vocab_size=cfg.vocab_size)
    with torch.no_grad():
        want = sum(torch.nn.functional.cross_entropy(
            hf_model(b["tokens"]).logits.flatten(0, 1), b["labels"].flatten()).item()
            for b in data.step_iterator(0)) / 4
    assert summary["first_loss"] == pytest.approx(want, abs=1e-5)
    assert summary["final_loss"] < summary["first_loss"]
    out = tmp_path / "hf_out"
    export_hf(str(tmp_path / "run"), str(out), log=lambda *_: None)
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(tuned).__name__ == "Qwen2ForCausalLM"
    moved = [(a - b).abs().max().item() for a, b in zip(tuned.parameters(),
                                                       hf_model.parameters())]
    assert max(moved) > 0  # trained weights, not the imported ones


@pytest.mark.timeout(120)
def test_mismatched_checkpoint_is_refused_before_any_collective(tmp_path, imported):
    _, _, ckpt = imported
    proc = ldt_train(tmp_path, "model=llama_tiny", f"train.load={ckpt}", ok=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.num_attention_heads=4 but this run has model.num_attention_heads=8" \
        in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "pids").exists()  # refused before any rank started


def test_shape_mismatch_names_the_parameter(imported):
    from ldt.models.arch import check_shapes, full_shapes
    from ldt.storage.tensors import check_compatible, tensor_index

    _, cfg, ckpt = imported
    check_compatible(str(ckpt), cfg)  # the import fits its own config
    shapes = {n: tuple(m.size) for n, (_, m) in tensor_index(str(ckpt)).items()}
    narrower = to_model({**cfg.__dict__, "ffn_hidden_size": 128})
    with pytest.raises(ConfigError, match=r"decoder.layers.0.mlp.linear_fc1.weight has shape "
                                          r"\(320, 64\) but this model config needs \(256, 64\)"):
        check_shapes(shapes, narrower, "x")
    assert set(shapes) == set(full_shapes(cfg))
    no_bias = {n: s for n, s in shapes.items() if not n.endswith("linear_qkv.bias")}
    with pytest.raises(ConfigError, match="has no parameter decoder.layers.0.self_attention"
                                          ".linear_qkv.bias"):
        check_shapes(no_bias, cfg, "x")


def test_rope_shim_applies_and_reverts():
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    from ldt import patches

    with patches.applied(["rope_cpu"]):
        assert rope.torch is not torch and rope.torch.cuda.current_device() == "cpu"
        assert rope.torch.cat is torch.cat  # everything else is torch's own
    assert rope.torch is torch


def test_ldt_convert_command_line(tmp_path, imported, capsys):
    from ldt.hydra_app import compose
    from ldt.models.arch import arch_of
    from ldt.tools.convert import main

    hf_model, cfg, ckpt = imported
    out = tmp_path / "mine"
    assert main(["import", str(ckpt.parent / "hf"), str(out), "--seq-length", "64"]) == 0
    printed = capsys.readouterr().out
    assert f"model=mine train.load={out}" in printed
    composed = to_model(compose([f"hydra.searchpath=[file://{out / 'conf'}]",
                                 "model=mine"]).model)
    assert arch_of(composed) == arch_of(cfg) and composed.seq_length == 64
    assert main(["import", str(tmp_path), str(tmp_path / "x")]) == 2  # no config.json
    assert "has no config.json" in capsys.readouterr().err
