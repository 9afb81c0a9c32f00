"""Clean XLA graphs for the model families users bring, not only BERT: tiny random RoBERTa,
DistilBERT (no token_type_ids), ELECTRA, ModernBERT and DeBERTa-v2 models, built here from their
configs with the bundled tokenizer, each trained 10 steps on XLA:CPU with buckets."""

import pytest
from conftest import run_cli

SIZE = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def configs(vocab):
    from transformers import (
        DebertaV2Config,
        DistilBertConfig,
        ElectraConfig,
        ModernBertConfig,
        RobertaConfig,
    )

    return {
        # RoBERTa-style: one token type (the tokenizer's token_type_ids are never passed)
        "roberta": RobertaConfig(vocab_size=vocab, hidden_size=32, type_vocab_size=1, pad_token_id=0,
                                 max_position_embeddings=514, **SIZE),
        "distilbert": DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=2, hidden_dim=64),
        "electra": ElectraConfig(vocab_size=vocab, embedding_size=32, hidden_size=32, **SIZE),
        "modernbert": ModernBertConfig(vocab_size=vocab, hidden_size=32, pad_token_id=0, bos_token_id=101,
                                       eos_token_id=102, cls_token_id=101, sep_token_id=102, **SIZE),
        # the head whose own loss uses (labels >= 0).nonzero(): a data-dependent shape
        "deberta-v2": DebertaV2Config(vocab_size=vocab, hidden_size=32, pooler_hidden_size=32, **SIZE),
    }


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from xla_train.models import bundled_model_path

    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    out = {}
    for name, config in configs(tok.vocab_size).items():
        torch.manual_seed(0)
        config.num_labels = 2
        path = tmp_path_factory.mktemp(name)
        AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
        tok.save_pretrained(path)
        out[name] = path
    return out


@pytest.mark.parametrize("family", ["roberta", "distilbert", "electra", "modernbert", "deberta-v2"])
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
