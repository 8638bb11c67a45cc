"""gems_models: built-in recipes, aliases, full-size shapes on meta, tiny variants, local configs, bad input."""
import json

import pytest
import torch

import gems_models
from gems_models import ModelError
from gems_models.config import with_layers


@pytest.mark.parametrize("alias,name", [("llama2", "meta-llama/Llama-2-7b"),
                                        ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b"),
                                        ("BERT", "bert-base-uncased"), ("llava", "llava-hf/llava-1.5-7b-hf"),
                                        ("aquila", "BAAI/Aquila-7B")])
def test_aliases(alias, name):
    assert gems_models.resolve(alias).name == name


def test_shipped_config_values():
    llama = gems_models.load_config(gems_models.resolve("llama2"))
    assert (llama.vocab_size, llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers,
            llama.num_attention_heads, llama.rms_norm_eps, llama.max_position_embeddings) == \
        (32000, 4096, 11008, 32, 32, 1e-5, 4096)
    aq = gems_models.load_config(gems_models.resolve("aquila"))
    assert (aq.vocab_size, aq.rms_norm_eps, aq.max_position_embeddings, aq.tie_word_embeddings) == \
        (100008, 1e-6, 2048, False)
    bert = gems_models.load_config(gems_models.resolve("bert"))
    assert (bert.vocab_size, bert.hidden_size, bert.num_hidden_layers, bert.intermediate_size) == \
        (30522, 768, 12, 3072)
    lv = gems_models.load_config(gems_models.resolve("llava"))
    assert lv.image_token_index == 32000 and lv.text_config.vocab_size == 32064
    assert (lv.vision_config.image_size, lv.vision_config.patch_size, lv.vision_config.num_hidden_layers) == \
        (336, 14, 24)
    assert lv.vision_feature_layer == -2 and lv.projector_hidden_act == "gelu"


@pytest.mark.parametrize("name,billions", [("llama2", 6.74), ("aquila", 7.30), ("llava", 7.06),
                                           ("bert", 0.11)])
def test_full_size_on_meta(name, billions):
    b = gems_models.build(name, size="full", device="meta", dtype="bfloat16", batch=2, seq_len=16)
    n = sum(p.numel() for p in b.model.parameters())
    assert abs(n / 1e9 - billions) < 0.01
    p = next(b.model.parameters())
    assert p.device.type == "meta" and p.dtype == torch.bfloat16
    assert b.inputs["input_ids"].shape[0] == 2


def test_tiny_inputs_are_realistic():
    b = gems_models.build("llava", size="tiny", device="cpu", dtype="float32", batch=2, seq_len=8)
    ids = b.inputs["input_ids"]
    n_img = int((ids == b.config.image_token_index).sum(dim=1)[0])
    assert n_img == b.config.image_seq_length == 4
    assert ids.shape == (2, 1 + 4 + 8) and b.inputs["pixel_values"].shape == (2, 3, 28, 28)
    assert (b.train_inputs["labels"][:, :5] == -100).all()
    bert = gems_models.build("bert", size="tiny", device="cpu")
    labels = bert.train_inputs["labels"]
    assert (labels != -100).any() and (labels == -100).any()
    assert bert.inputs["attention_mask"].dtype == torch.long


def test_local_config_and_folder(tmp_path):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000}
    f = tmp_path / "my.json"
    f.write_text(json.dumps(cfg))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text(json.dumps(cfg))
    for name in (str(f), str(tmp_path / "folder")):
        r = gems_models.resolve(name)
        assert r.kind == "causal_lm" and r.source == "config"
        b = gems_models.build(r, size="full", device="meta")
        assert b.model.config.hidden_size == 128
        t = gems_models.build(r, size="tiny", device="cpu")
        assert t.model.config.hidden_size == 64


def test_remote_code_aquila_config_builds_as_llama(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"model_type": "aquila", "architectures": ["AquilaModel"],
                             "auto_map": {"AutoModelForCausalLM": "modeling_aquila.AquilaForCausalLM"},
                             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                             "num_attention_heads": 4, "vocab_size": 300}))
    b = gems_models.build(str(tmp_path), device="meta")
    assert type(b.model).__name__ == "LlamaForCausalLM"


def test_module_function(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def tiny_mlp(device='cpu', dtype=torch.float32):\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))\n"
        "    m = m.to(device=device, dtype=dtype)\n"
        "    return m, (torch.randn(2, 8, device=device, dtype=dtype),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    b = gems_models.build("mymodels:tiny_mlp", device="meta")
    assert b.custom_args[0].shape == (2, 8) and b.kind == "custom"


@pytest.mark.parametrize("name,msg", [("no-such-model", "unknown model"), ("", "empty"),
                                      ("nosuchmodule_xyz:f", "cannot import")])
def test_bad_names(name, msg):
    with pytest.raises(ModelError, match=msg):
        gems_models.resolve(name)


def test_malformed_configs(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{ not json")
    with pytest.raises(ModelError, match="malformed config JSON"):
        gems_models.resolve(str(bad_json))
    no_type = tmp_path / "notype.json"
    no_type.write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ModelError, match="model_type"):
        gems_models.resolve(str(no_type))
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"model_type": "bert", "hidden_size": 100, "num_attention_heads": 12}))
    with pytest.raises(ModelError, match="not a multiple of the number of attention heads"):
        gems_models.build(str(heads), device="meta")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "not-a-real-arch"}))
    with pytest.raises(ModelError, match="unsupported model_type"):
        gems_models.build(str(unknown), device="meta")
    with pytest.raises(ModelError, match="unknown dtype"):
        gems_models.parse_dtype("float13")


def _gpt2_folder(tmp_path):
    """A GPT-2 config folder (as `cfgs/gpt2` would be): GPT2Config's own keys, dropouts named *_pdrop and
    summary_first_dropout, small dims."""
    import transformers
    d = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                bos_token_id=1, eos_token_id=2, architectures=["GPT2LMHeadModel"]).to_dict()
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return folder


def test_dropout_zero_reaches_every_dropout_probability(tmp_path):
    """build(dropout=0.0) zeroes every dropout probability, whatever the architecture names it (GPT-2's
    attn_pdrop / resid_pdrop / embd_pdrop, summary_first_dropout; BERT's *_dropout_prob): no active
    dropout in the model, and training-mode forwards repeat exactly."""
    import transformers
    folder = _gpt2_folder(tmp_path)
    b = gems_models.build(str(folder), size="full", device="cpu", dtype="float32", seq_len=8, dropout=0.0)
    c = b.model.config
    assert (c.attn_pdrop, c.resid_pdrop, c.embd_pdrop, c.summary_first_dropout) == (0.0, 0.0, 0.0, 0.0)
    drops = [m for m in b.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0 for m in drops), [m.p for m in drops]
    b.model.train()
    x = b.train_inputs["input_ids"]
    torch.testing.assert_close(b.model(x).logits, b.model(x).logits, rtol=0, atol=0)
    # without dropout= the model's own values stay
    kept = gems_models.build(str(folder), size="full", device="meta", seq_len=8)
    assert kept.model.config.attn_pdrop == 0.1
    # BERT: *_dropout_prob zeroed; classifier_dropout (None) and non-dropout floats left alone
    cfg = transformers.BertConfig(layer_norm_eps=0.5)
    gems_models.builder._set_dropout(cfg, 0.0)
    assert (cfg.hidden_dropout_prob, cfg.attention_probs_dropout_prob) == (0.0, 0.0)
    assert cfg.classifier_dropout is None and cfg.layer_norm_eps == 0.5


def test_layers_sets_every_stacks_depth_and_cuts_per_layer_lists():
    d = {"num_hidden_layers": 28, "layer_types": ["full_attention", "sliding_attention"] * 14, "hidden_size": 8,
         "text_config": {"num_hidden_layers": 32}, "vision_config": {"num_hidden_layers": 24}, "n_layer": 12}
    out = with_layers(d, 2)
    assert out["num_hidden_layers"] == 2 and out["n_layer"] == 2 and out["hidden_size"] == 8
    assert out["layer_types"] == ["full_attention", "sliding_attention"]
    assert out["text_config"]["num_hidden_layers"] == 2 and out["vision_config"]["num_hidden_layers"] == 2
    assert d["num_hidden_layers"] == 28                    # the input is not changed


def test_build_layers_builds_a_shallow_model_of_the_same_widths():
    full, shallow = gems_models.load_config(gems_models.resolve("bert")), gems_models.build("bert", size="full", layers=1).model
    assert len(shallow.bert.encoder.layer) == 1
    assert shallow.config.hidden_size == full.hidden_size and shallow.config.intermediate_size == full.intermediate_size
    with pytest.raises(ModelError, match="layers must be >= 1"):
        gems_models.load_config(gems_models.resolve("bert"), layers=0)
