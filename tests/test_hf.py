"""Hugging Face checkpoints in and out, against ``transformers``' own implementation.

Tiny random ``LlamaForCausalLM`` (GQA 8 heads / 4 KV groups, RoPE base 5000, untied, saved in
several safetensors shards), ``Qwen2ForCausalLM`` (QKV biases, tied head, a vocabulary of
250 that ldt pads), a Llama 3.1 (``rope_type: llama3`` with frequency factors and a
pre-training length that are not megatron's defaults, so the band between them is
interpolated), ``Qwen3ForCausalLM`` (QK norms, head size 32 over a hidden size of 64 with 4
heads) and ``Qwen3MoeForCausalLM`` (4 experts, top-2, a dense first layer) are built offline
from a config, saved, imported with ``ldt-convert``'s library, and run by ldt in one 4-process
world:

- logits on a plain VTP pipeline (TP 1/2/1) and on a U-shape (TP 1/2/1) equal transformers'
  within 1e-5 (fp32); the MoE model also with its experts spread over the TP 2 stage
  (``ep: 2``), under sequence parallelism as megatron's MoE layer needs with TP > 1;
- TP 1 vs 2 vs 4 of the SwiGLU + GQA model from the same checkpoint: same losses (1e-6) and
  gradients (1e-5);
- every shard a rank holds is where megatron-core's ``sharded_state_dict()`` puts it;
- export gives back the same tensors bit for bit, and transformers loads it with the same
  logits.
"""

import json
import os

import pytest
import torch

from ldt.config import to_model
from ldt.launch.local import run_local_world
from model_worlds import batches, world

SEQ = 16
LOGITS_ATOL = 1e-5


def _hf_model(kind: str):
    import transformers

    common = dict(hidden_size=64, num_hidden_layers=4, max_position_embeddings=64)
    qwen3 = dict(vocab_size=256, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, **common)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=256, intermediate_size=128,
                                       num_attention_heads=8, num_key_value_heads=4,
                                       rope_theta=5000.0, rms_norm_eps=1e-5,
                                       tie_word_embeddings=False, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama3":  # head size 8: wavelengths 6 (kept: < 32/8), 63, 628, 6283 (/ 4)
        cfg = transformers.LlamaConfig(
            vocab_size=256, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                             "low_freq_factor": 0.5, "high_freq_factor": 8.0,
                             "original_max_position_embeddings": 32},
            rms_norm_eps=1e-5, tie_word_embeddings=False, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**qwen3))
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
            norm_topk_prob=True, router_aux_loss_coef=0.01, **qwen3))
    else:
        cfg = transformers.Qwen2Config(vocab_size=250, intermediate_size=96,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       rope_theta=1e6, rms_norm_eps=1e-6,
                                       tie_word_embeddings=True, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms and biases away from 1 and 0, so a wrong mapping shows
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _hf_logits(model, vocab_size):
    with torch.no_grad():
        return [model(b["tokens"]).logits for b in batches(vocab_size, SEQ)]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{kind: (HF folder, ldt checkpoint, ModelConfig, transformers' logits)}."""
    from ldt.models.hf import import_hf

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in FAMILIES:
        model = _hf_model(kind)
        folder, ckpt = root / f"hf_{kind}", root / f"ldt_{kind}"
        model.save_pretrained(folder, max_shard_size="200KB" if kind == "llama" else "1GB")
        cfg = import_hf(str(folder), str(ckpt), log=lambda *_: None)
        out[kind] = (folder, ckpt, cfg, _hf_logits(model, cfg.vocab_size))
    return out


FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}


def _cluster(tps, layout, u_shape=False, eps=None):
    return {"stages": [{"name": f"s{i}", "device": "cpu", "tp": t, "ep": (eps or {}).get(i, 1)}
                       for i, t in enumerate(tps)],
            "u_shape": u_shape, "layout": layout}


def _model(hf, kind, **over):
    import dataclasses

    cfg = hf[kind][2]
    fields = dict(seq_length=SEQ, **over)
    if kind == "llama":
        fields.setdefault("make_vocab_size_divisible_by", 64)  # 256 rows on TP 1, 2 and 4
    return to_model({**dataclasses.asdict(cfg), **fields})


CASES = {  # name -> (family, cluster, kind, model overrides, check the sharding oracle)
    "llama_vtp121": ("llama", _cluster([1, 2, 1], "Et|tt|tL"), "logits", {}, False),
    "qwen2_vtp121": ("qwen2", _cluster([1, 2, 1], "Et|tt|tL"), "logits",
                     {"tie_embeddings": False}, True),  # a tied checkpoint, untied run
    "llama_ushape121": ("llama", _cluster([1, 2, 1], "Et|t|t|tL", True), "logits", {}, False),
    "qwen2_ushape121": ("qwen2", _cluster([1, 2, 1], "Et|t|t|tL", True), "logits", {}, False),
    "llama3_vtp121": ("llama3", _cluster([1, 2, 1], "Et|tt|tL"), "logits", {}, False),
    "llama3_ushape121": ("llama3", _cluster([1, 2, 1], "Et|t|t|tL", True), "logits", {}, False),
    "qwen3_vtp121": ("qwen3", _cluster([1, 2, 1], "Et|tt|tL"), "logits", {}, True),
    "qwen3_ushape121": ("qwen3", _cluster([1, 2, 1], "Et|t|t|tL", True), "logits", {}, False),
    "qwen3_moe_vtp121": ("qwen3_moe", _cluster([1, 2, 1], "Et|tt|tL"), "logits",
                         {"sequence_parallel": True}, False),
    "qwen3_moe_ushape121": ("qwen3_moe", _cluster([1, 2, 1], "Et|t|t|tL", True), "logits",
                            {"sequence_parallel": True}, False),
    "qwen3_moe_ep2": ("qwen3_moe", _cluster([1, 2, 1], "Et|tt|tL", eps={1: 2}), "logits",
                      {"sequence_parallel": True}, False),
    "llama_tp1": ("llama", _cluster([1, 1, 1, 1], "Et|t|t|tL"), "train", {}, False),
    "llama_tp2": ("llama", _cluster([2, 2], "Ett|ttL"), "train", {}, True),
    "llama_tp4": ("llama", _cluster([4], None), "train", {}, True),
    # no checkpoint: ldt's layout-invariant init of the same SwiGLU + GQA model
    "init_tp1": ("llama", _cluster([1, 1, 1, 1], "Et|t|t|tL"), "train", {}, None),
    "init_tp2": ("llama", _cluster([2, 2], "Ett|ttL"), "train", {}, None),
    "init_tp4": ("llama", _cluster([4], None), "train", {}, None),
}


@pytest.fixture(scope="module")
def ran(hf):
    cases = [{"model": _model(hf, fam, **over), "cluster": cluster, "kind": kind,
              "checkpoint": None if oracle is None else str(hf[fam][1]), "oracle": oracle}
             for fam, cluster, kind, over, oracle in CASES.values()]
    out = run_local_world(4, world, (cases,), timeout_s=400)
    return {name: [rank[i] for rank in out] for i, name in enumerate(CASES)}


def _loss_stage_results(per_rank):
    stage = max(r["stage"] for r in per_rank)
    return [r for r in per_rank if r["stage"] == stage and r["tp_rank"] == 0][0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] == "logits"])
def test_logits_equal_transformers(hf, ran, name):
    family = CASES[name][0]
    vocab = hf[family][2].vocab_size
    per_rank = ran[name]
    u_shape = CASES[name][1]["u_shape"]
    got = [r for r in per_rank if r["stage"] == (0 if u_shape else 2)]
    assert got and all(len(r["logits"]) == 2 for r in got)
    for r in got:  # every TP rank of the loss stage gathered the whole vocabulary
        for ours, want in zip(r["logits"], hf[family][3]):
            assert ours.shape[-1] >= vocab
            diff = (ours[..., :vocab] - want).abs().max().item()
            assert diff <= LOGITS_ATOL, (name, diff)
    assert all("logits" not in r or r["logits"] == [] for r in per_rank if r not in got)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("start", ["llama", "init"])
def test_tp_1_2_4_same_loss_and_grads(ran, start):
    """From the imported checkpoint, and from ldt's layout-invariant init."""
    from ldt.models.sharding import unshard

    results = {}
    for tp in (1, 2, 4):
        name = f"{start}_tp{tp}"
        per_rank = ran[name]
        assert all(r["gated"] for r in per_rank)
        shards = {}
        for r in per_rank:
            for n, g in r["grads"].items():
                shards.setdefault(n, {})[r["tp_rank"]] = g
        grads = {n: unshard(n, [s[i] for i in sorted(s)], gated=True)
                 for n, s in shards.items()}
        results[tp] = (_loss_stage_results(per_rank)["losses"], grads)
    base_losses, base_grads = results[1]
    assert len(base_losses) == 2
    for name in (2, 4):
        losses, grads = results[name]
        assert losses == pytest.approx(base_losses, abs=1e-6), name
        assert set(grads) == set(base_grads)
        for n, g in base_grads.items():
            assert (grads[n] - g).abs().max().item() <= 1e-5, (name, n)


@pytest.mark.timeout(600)
def test_megatron_expert_groups_answer_per_stage(ran):
    """The MoE cases' stage 1 (TP 2): with ep 2 megatron's getters see 2 expert-parallel ranks
    of whole experts (expert TP 1), each holding its half of the 4 experts; with ep 1 one
    expert-parallel rank and the experts split over the stage's 2 TP ranks; stages 0 and 2
    (TP 1) see size 1 everywhere."""
    for name, ep in (("qwen3_moe_ep2", 2), ("qwen3_moe_vtp121", 1)):
        for r in ran[name]:
            t = r["tp_rank"]
            if r["stage"] == 1:
                want = (2, t, 1, 0, 1) if ep == 2 else (1, 0, 2, t, 1)
                layers = [[2 * t, 2 * t + 1]] * 2 if ep == 2 else [[0, 1, 2, 3]] * 2
            else:
                want, layers = (1, 0, 1, 0, 1), [[0, 1, 2, 3]] * (r["stage"] == 2)
            assert r["experts"] == want and r["local_experts"] == layers, (name, r["stage"], t)


@pytest.mark.timeout(600)
def test_shards_are_where_megatron_puts_them(ran):
    checked = 0
    for name, (_, _, _, _, oracle) in CASES.items():  # None: no checkpoint
        if oracle:
            for r in ran[name]:
                assert r["oracle"] == [], (name, r["stage"], r["tp_rank"], r["oracle"][:3])
                checked += 1
    assert checked >= 4 + 4 + 4


@pytest.mark.timeout(600)
def test_full_shapes_match_the_built_model(hf, ran):
    from ldt.models.arch import full_shapes

    model = _model(hf, "llama")
    built = {n: s for r in ran["llama_tp1"] for n, s in r["shapes"].items()}
    assert built == full_shapes(model)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_round_trips_bit_for_bit_and_loads_in_transformers(hf, tmp_path, family):
    import transformers
    from safetensors import safe_open

    from ldt.models.hf import export_hf

    folder, ckpt, cfg, want = hf[family]
    out = tmp_path / "exported"
    export_hf(str(ckpt), str(out), log=lambda *_: None)

    def tensors(path):
        found = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    found.update({k: f.get_tensor(k) for k in f.keys()})
        return found

    src, back = tensors(folder), tensors(out)
    assert set(back) == set(src)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == FAMILIES[family]
    for ours, theirs in zip(_hf_logits(reloaded, cfg.vocab_size), want):
        assert torch.equal(ours, theirs)
    exported = json.loads((out / "config.json").read_text())
    source = json.loads((folder / "config.json").read_text())
    assert exported["tie_word_embeddings"] == (family == "qwen2")
    for key in ("rope_parameters", "head_dim", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "mlp_only_layers", "norm_topk_prob",
                "router_aux_loss_coef"):  # what each family maps, written back as it came
        assert exported.get(key) == source.get(key), key


def test_llama3_rope_frequencies_are_transformers():
    """megatron's RoPE scaling (with ldt's frequency factors) gives transformers' ``llama3``
    frequencies, for Llama 3.1's values and for others (a band of interpolated wavelengths)."""
    import transformers
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ldt.patches.rope_scaling import set_llama3_frequencies

    for factor, low, high, original, dim in ((8.0, 1.0, 4.0, 8192, 128),
                                             (4.0, 0.5, 8.0, 32, 8), (32.0, 1.0, 4.0, 8192, 64)):
        hf = transformers.LlamaConfig(
            hidden_size=dim * 4, num_attention_heads=4, max_position_embeddings=2 * original,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor,
                             "low_freq_factor": low, "high_freq_factor": high,
                             "original_max_position_embeddings": original})
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
        emb = RotaryEmbedding(dim, 1.0, rotary_base=500000.0, rope_scaling=True,
                              rope_scaling_factor=factor, use_cpu_initialization=True)
        set_llama3_frequencies(emb, kv_channels=dim, rotary_percent=1.0, rotary_base=500000.0,
                               factor=factor, low_freq_factor=low, high_freq_factor=high,
                               original_max_position_embeddings=original)
        assert torch.allclose(emb.inv_freq, want, rtol=1e-6, atol=0), (factor, low, high)
        plain = 1.0 / 500000.0 ** (torch.arange(0, dim, 2).float() / dim)
        assert not torch.allclose(emb.inv_freq, plain)  # the scaling changed something


def test_a_tied_checkpoint_with_a_head_of_its_own_imports_both_as_transformers_runs_them(
        tmp_path):
    """config.json ties the head, the file still holds an lm_head.weight of other values:
    transformers computes with each tensor in its own role, and so must the import (not the
    embedding overwritten by the head, or two copies trained as one)."""
    import transformers
    from safetensors.torch import load_file, save_file

    from ldt.models.hf import import_hf
    from ldt.models.tensor_files import read_tensors, tensor_index

    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    for name, head in (("same", embed.clone()), ("own", torch.randn_like(embed))):
        save_file({**weights, "lm_head.weight": head}, tmp_path / "hf" / "model.safetensors",
                  metadata={"format": "pt"})
        cfg = import_hf(str(tmp_path / "hf"), str(tmp_path / name), log=lambda *_: None)
        assert cfg.tie_embeddings == (name == "same"), name
        got = read_tensors(tensor_index(str(tmp_path / name)),
                           ["embedding.word_embeddings.weight", "output_layer.weight"])
        assert torch.equal(got["embedding.word_embeddings.weight"], embed)
        assert torch.equal(got["output_layer.weight"], head)


def test_a_tied_head_is_compared_with_the_embedding_a_slice_at_a_time(tmp_path, monkeypatch):
    """Not both read whole (about 1 GB each for a 7B model): at most HEAD_COMPARE_BYTES of
    each at a time, and a difference in the last row is still found."""
    from safetensors.torch import save_file

    from ldt.models.hf import convert

    budget = 3 * 8 * 4  # three rows of 4 elements at the widest dtype's 8 bytes
    monkeypatch.setattr(convert, "HEAD_COMPARE_BYTES", budget)
    reads = []
    read_rows = convert.SafetensorsFolder.read_rows

    def counted(self, name, start, stop):
        rows = read_rows(self, name, start, stop)
        reads.append(rows.numel() * rows.element_size())
        return rows

    monkeypatch.setattr(convert.SafetensorsFolder, "read_rows", counted)
    embed = torch.randn(10, 4)
    last_row_differs = embed.clone()
    last_row_differs[-1, -1] += 1
    for head, own in ((embed.clone(), False), (last_row_differs, True)):
        save_file({"model.embed_tokens.weight": embed, "lm_head.weight": head},
                  tmp_path / "model.safetensors")
        reads.clear()
        assert convert._own_head(convert.SafetensorsFolder(str(tmp_path))) == own
        assert len(reads) == 2 * 4 and max(reads) <= budget  # 4 slices of each, every row


def test_an_export_of_a_run_trained_from_scratch_names_no_special_tokens(hf, tmp_path):
    """Without an import's config.json, transformers' default ids (Llama: bos 1, eos 2) would
    name tokens the run never trained as such (generate would stop at a random token): the
    export leaves them null and says so."""
    from ldt.models.arch import read_model_json, write_model_json
    from ldt.models.hf import export_hf
    from ldt.models.hf.convert import parts
    from ldt.models.tensor_files import mark_complete, read_tensors, tensor_index, write_tensors

    imported = str(hf["llama"][1])
    model, index = read_model_json(imported), tensor_index(imported)
    step = tmp_path / "run" / "checkpoints" / "step_0000001"  # as ldt-train writes one
    for k, names in enumerate(parts(model)):
        write_tensors(str(step), k, read_tensors(index, names), 1)
    write_model_json(str(step), model)
    mark_complete(str(step), 1)
    said = []
    export_hf(str(tmp_path / "run"), str(tmp_path / "out"), log=said.append)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert [config.get(k, "absent") for k in ("bos_token_id", "eos_token_id", "pad_token_id")] \
        == [None, None, None]
    assert "trained from scratch" in said[0] and "set eos_token_id" in said[0]


def test_llama3_rope_scaling_is_imported_for_llama_only():
    """docs/models.md: RoPE scaling is refused for Qwen2 and Qwen3 (export could not write
    it back), at import, not after training."""
    import transformers

    from ldt.config import ConfigError
    from ldt.models.hf.families import FAMILIES

    rope = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf = transformers.Qwen2Config(hidden_size=32, num_attention_heads=4,
                                  num_key_value_heads=2, rope_parameters=rope)
    with pytest.raises(ConfigError, match="rope_type 'llama3'.*LlamaForCausalLM only"):
        FAMILIES["Qwen2ForCausalLM"].model_fields(hf)


def test_the_command_lines_import_passes_the_load_checks(hf, tmp_path, capsys):
    """``ldt-convert import`` writes ``OUT/conf/model/NAME.yaml`` next to the parts: the
    checks of ``train.load=OUT`` take the parts (``stage_*``) and leave ``conf/`` alone, and a
    damaged part is reported in terms of ``train.load``, the field the user gave."""
    from ldt.storage import checkpoint_files as files
    from ldt.models.tensor_files import check_compatible
    from ldt.tools.convert import main as convert

    folder, _, cfg, _ = hf["llama"]
    out = tmp_path / "mine"
    assert convert(["import", str(folder), str(out)]) == 0
    assert "train.load=" in capsys.readouterr().out
    assert (out / "conf" / "model" / "mine.yaml").exists()
    assert files.parts(str(out)) == [f"stage_{k}" for k in range(cfg.num_layers + 2)]
    assert files.preflight(str(out), "train.load") == str(out)
    check_compatible(str(out), cfg)
    step = tmp_path / "run" / "checkpoints" / "step_0000009"  # what a save of a run from it gets
    step.mkdir(parents=True)
    assert files.carry_companions(str(out), str(step), own=("model.json",)) == [
        "generation_config.json", "hf_config.json"]
    (out / "stage_1" / files.MANIFEST).write_text("{")
    with pytest.raises(files.CheckpointError, match="train.load") as refused:
        files.preflight(str(out), "train.load")
    assert "train.resume" not in str(refused.value)


def test_export_refuses_what_transformers_would_not_load(hf, tmp_path, monkeypatch):
    """The export checks every tensor against transformers' own model of the config it writes
    (a skeleton without weights): a config.json that disagrees with the tensors is refused."""
    from ldt.config import ConfigError
    from ldt.models.hf import convert
    from ldt.models.hf.families import Family

    _, ckpt, _, _ = hf["llama"]
    real = Family.hf_config

    def wrong_ffn(self, model, dtype, base=None):
        config = real(self, model, dtype, base)
        config.intermediate_size += 2
        return config
    monkeypatch.setattr(Family, "hf_config", wrong_ffn)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight of shape "
                                          r"\(128, 64\), but transformers' LlamaForCausalLM "
                                          r"has \(130, 64\)"):
        convert.export_hf(str(ckpt), str(tmp_path / "out"), log=lambda *_: None)
    assert not (tmp_path / "out" / "config.json").exists()
