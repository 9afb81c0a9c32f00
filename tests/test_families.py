"""Clean XLA graphs for the model families users bring, not only BERT: tiny random BERT, RoBERTa,
DistilBERT (no token_type_ids), ELECTRA, ModernBERT and DeBERTa-v2 models, each written from the
published config.json of the checkpoint it stands for (`ENCODERS`) with every flag kept and
shrunk in width and depth only, built with the bundled tokenizer (so its vocabulary and token ids
replace the published ones), each trained 10 steps on XLA:CPU with buckets. The decoders' zoo is
tests/tiny_decoders.py (its matrix: tests/test_matrix.py)."""

import pytest
from conftest import run_cli

# Sizes: the published ones shrunk to this width and depth in the published proportions (the MLP
# as many times the width; ELECTRA-small's embeddings half its width).
WIDTH, LAYERS, HEADS = 32, 2, 2
SIZE = dict(num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=64)  # bench_families.py's BERT

# name: the checkpoint, its config.json as published (token ids and sizes replaced below)
ENCODERS = {
    "bert": {
        "checkpoint": "google-bert/bert-base-uncased",
        "config": {"architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1,
                   "gradient_checkpointing": False, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                   "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-12,
                   "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12,
                   "num_hidden_layers": 12, "pad_token_id": 0, "position_embedding_type": "absolute",
                   "type_vocab_size": 2, "use_cache": True,
                   "vocab_size": 30522},
    },
    # one token type (the tokenizer's token_type_ids are never passed); 514 positions (padding's offset)
    "roberta": {
        "checkpoint": "FacebookAI/roberta-base",
        "config": {"architectures": ["RobertaForMaskedLM"], "attention_probs_dropout_prob": 0.1, "bos_token_id": 0,
                   "eos_token_id": 2, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768,
                   "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
                   "max_position_embeddings": 514, "model_type": "roberta", "num_attention_heads": 12,
                   "num_hidden_layers": 12, "pad_token_id": 1, "type_vocab_size": 1, "vocab_size": 50265},
    },
    # no token_type_ids at all
    "distilbert": {
        "checkpoint": "distilbert/distilbert-base-uncased",
        "config": {"activation": "gelu", "architectures": ["DistilBertForMaskedLM"], "attention_dropout": 0.1,
                   "dim": 768, "dropout": 0.1, "hidden_dim": 3072, "initializer_range": 0.02,
                   "max_position_embeddings": 512, "model_type": "distilbert", "n_heads": 12, "n_layers": 6,
                   "pad_token_id": 0, "qa_dropout": 0.1, "seq_classif_dropout": 0.2, "sinusoidal_pos_embds": False,
                   "tie_weights_": True, "vocab_size": 30522},
    },
    # embeddings narrower than the hidden layers (a projection between)
    "electra": {
        "checkpoint": "google/electra-small-discriminator",
        "config": {"architectures": ["ElectraForPreTraining"], "attention_probs_dropout_prob": 0.1,
                   "embedding_size": 128, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 256,
                   "initializer_range": 0.02, "intermediate_size": 1024, "layer_norm_eps": 1e-12,
                   "max_position_embeddings": 512, "model_type": "electra", "num_attention_heads": 4,
                   "num_hidden_layers": 12, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": 30522},
    },
    # global attention every third layer, the others a 128-token window (a 2-layer model keeps one
    # of each); RoPE with a theta per kind; no biases in norms, MLPs and attention; mean pooling
    "modernbert": {
        "checkpoint": "answerdotai/ModernBERT-base",
        "config": {"architectures": ["ModernBertForMaskedLM"], "attention_bias": False, "attention_dropout": 0.0,
                   "bos_token_id": 50281, "classifier_activation": "gelu", "classifier_bias": False,
                   "classifier_dropout": 0.0, "classifier_pooling": "mean", "cls_token_id": 50281,
                   "decoder_bias": True, "deterministic_flash_attn": False, "embedding_dropout": 0.0,
                   "eos_token_id": 50282, "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0,
                   "gradient_checkpointing": False, "hidden_activation": "gelu", "hidden_size": 768,
                   "initializer_cutoff_factor": 2.0, "initializer_range": 0.02, "intermediate_size": 1152,
                   "layer_norm_eps": 1e-05, "local_attention": 128, "local_rope_theta": 10000.0,
                   "max_position_embeddings": 8192, "mlp_bias": False, "mlp_dropout": 0.0, "model_type": "modernbert",
                   "norm_bias": False, "norm_eps": 1e-05, "num_attention_heads": 12, "num_hidden_layers": 22,
                   "pad_token_id": 50283, "position_embedding_type": "absolute", "sep_token_id": 50282,
                   "tie_word_embeddings": True, "torch_dtype": "float32", "vocab_size": 50368},
    },
    # DeBERTa-v3 (model type deberta-v2): relative attention only (no absolute positions, no token
    # types), log-bucketed positions shared with the keys; the head whose own loss uses
    # (labels >= 0).nonzero(): a data-dependent shape
    "deberta-v2": {
        "checkpoint": "microsoft/deberta-v3-base",
        "config": {"attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                   "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-07,
                   "max_position_embeddings": 512, "max_relative_positions": -1, "model_type": "deberta-v2",
                   "norm_rel_ebd": "layer_norm", "num_attention_heads": 12, "num_hidden_layers": 12,
                   "pad_token_id": 0, "pooler_dropout": 0, "pooler_hidden_act": "gelu", "pooler_hidden_size": 768,
                   "pos_att_type": ["p2c", "c2p"], "position_biased_input": False, "position_buckets": 256,
                   "relative_attention": True, "share_att_key": True, "type_vocab_size": 0, "vocab_size": 128100},
    },
}

_SIZE_KEYS = {  # the published config's names for width, depth, heads and the MLP
    "distilbert": ("dim", "n_layers", "n_heads", "hidden_dim"),
}


def shrunk(name, published, vocab, tok):
    """The published config `WIDTH` wide and `LAYERS` deep, over the bundled tokenizer's vocabulary
    and special tokens."""
    width, layers, heads, mlp = _SIZE_KEYS.get(name, ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                      "intermediate_size"))
    config = dict(published, vocab_size=vocab)
    config.update({width: WIDTH, layers: LAYERS, heads: HEADS, mlp: WIDTH * published[mlp] // published[width]})
    if "embedding_size" in config:
        config["embedding_size"] = WIDTH * published["embedding_size"] // published[width]
    if "pooler_hidden_size" in config:
        config["pooler_hidden_size"] = WIDTH
    ids = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.cls_token_id, "cls_token_id": tok.cls_token_id,
           "eos_token_id": tok.sep_token_id, "sep_token_id": tok.sep_token_id}
    config.update({k: v for k, v in ids.items() if k in config})
    return config


def configs(vocab, tok=None):
    """Every encoder's shrunk config over a vocabulary of `vocab` tokens (the bundled tokenizer's)."""
    from transformers import CONFIG_MAPPING, AutoTokenizer

    from xla_train.models import bundled_model_path

    tok = tok or AutoTokenizer.from_pretrained(bundled_model_path())
    return {name: CONFIG_MAPPING[e["config"]["model_type"]].from_dict(shrunk(name, e["config"], vocab, tok))
            for name, e in ENCODERS.items()}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from xla_train.models import bundled_model_path

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    out = {}
    for name, config in configs(tok.vocab_size, tok).items():
        torch.manual_seed(0)
        config.num_labels = 2
        path = tmp_path_factory.mktemp(name)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
        tok.save_pretrained(path)
        out[name] = path
    return out


@pytest.mark.parametrize("family", list(ENCODERS))
def test_one_graph_per_step_and_no_host_reads(family, family_models, mrpc_slice, tmp_path):
    proc, m = run_cli(["--backend", "xla", "--model", family_models[family], "--data-dir", mrpc_slice,
                       "--max-steps", 10, "--log-every", 10, "--buckets", "128"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    xla = m["xla"]
    assert xla["aten_fallbacks"] == 0, xla
    assert xla["host_syncs_per_step"] <= 0.1, xla  # the one loss read at step 10
    eval_batches = 48 // 8
    # a graph per training step and per evaluation batch; the end of the run's reads add at most two
    assert xla["executions"] <= 10 + eval_batches + 2, xla
    assert m["eval"]["n"] == 48
    assert "recompilation" not in proc.stderr


def test_the_encoders_carry_the_published_flags():
    """Read back by transformers from the shrunk configs: the flags that set these families apart."""
    from transformers import AutoTokenizer

    from xla_train.models import bundled_model_path

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    c = configs(tok.vocab_size, tok)
    assert all(ENCODERS[name]["checkpoint"] for name in c)
    assert c["bert"].type_vocab_size == 2 and c["bert"].hidden_dropout_prob == 0.1 and c["bert"].hidden_size == WIDTH
    assert c["roberta"].type_vocab_size == 1 and c["roberta"].max_position_embeddings == 514
    assert c["distilbert"].dim == WIDTH and c["distilbert"].seq_classif_dropout == 0.2
    assert c["electra"].embedding_size == WIDTH // 2 < c["electra"].hidden_size
    modernbert = c["modernbert"]
    assert modernbert.layer_types == ["full_attention", "sliding_attention"] and modernbert.local_attention == 128
    assert modernbert.classifier_pooling == "mean" and not modernbert.norm_bias and not modernbert.mlp_bias
    assert modernbert.intermediate_size == WIDTH * 1152 // 768
    deberta = c["deberta-v2"]
    assert deberta.relative_attention and not deberta.position_biased_input and deberta.type_vocab_size == 0
    assert deberta.position_buckets == 256 and deberta.share_att_key and list(deberta.pos_att_type) == ["p2c", "c2p"]
    assert all(cfg.pad_token_id == tok.pad_token_id for cfg in c.values())  # the bundled tokenizer's ids
