"""Tiny random decoders for the causal-LM tests and benchmarks, and a synthetic task a tiny model
learns in minutes: reversing a short list of letters.

The zoo (`ZOO`): each family's tiny decoder is written from the published config.json of the
checkpoint users bring (named in its entry), with every flag kept (tied embeddings, grouped-query
attention, attention biases, sliding windows, logit soft-capping, Llama 3's RoPE scaling, which
tokens exist and which one pads) and shrunk in width and depth only (`shrunk`); transformers reads
it as it reads that config.json (legacy keys such as `rope_scaling` and `rope_theta` included).
The vocabulary and its token ids are the tokenizer's (Qwen2.5's embedding keeps its extra rows).

Tokenizers: the bundled MiniLM WordPiece vocabulary as a decoder's (`tokenizer`: [CLS] begins a
text, [SEP] ends it, no padding token), the synthetic task's 17 words (`letters_tokenizer`), or a
tiny tokenizer of the family's own kind (byte-level or SentencePiece-style BPE learnt from the
synthetic task) with its special tokens, padding, length limit and chat template
(`family_tokenizer`: what `save(..., own_tokens=True)` writes beside the model, with the
checkpoint's generation_config.json)."""

import json
import random
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [SEP] {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
FAMILIES = ("llama", "qwen2", "gemma", "gemma2", "mistral", "gpt2")
LETTERS = "abcdefgh"
MODEL_MAX_LENGTH = 512  # `tokenizer` and `letters_tokenizer`: MiniLM's own limit (test_generate reads it)

# The published chat templates' markup and their assistant's end-of-turn, without the default
# system text some of them add (Llama 3.2's dates, Qwen's "You are Qwen..."): its words are not
# in the tiny vocabulary.
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
                  "else m['role'] %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# The late-2026 families' templates, each the published markup of a user/assistant exchange (and
# of a system turn where the published template has one) with the published default system text
# left out; where each was read is in LATE_TOKENS below.
# Qwen3 (Qwen3-0.6B's tokenizer_config.json; Qwen3-30B-A3B shares the tokenizer): ChatML; the
# assistant turn after the last user turn opens with an empty thought ("<think>\n\n</think>\n\n",
# reasoning_content's place), earlier assistant turns without it; enable_thinking=False puts the
# empty thought in the generation prompt. Left out: tools, reasoning_content and <think> parsing.
QWEN3_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
                  "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
                  "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")
# Gemma 3 (gemma-3-1b-it's template as a GGUF of it and gemma-3-4b-it's tokenizer_config.json
# carry it): Gemma's turns, a system message folded into the first user turn, images left out
GEMMA3_TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
                   "{% set first = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
                   "{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
                   "{% for m in loop_messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
                   "<start_of_turn>{{ role }}\n{{ first if loop.first else '' }}{{ m['content'] | trim }}"
                   "<end_of_turn>\n"
                   "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# SmolLM3-3B: its template in /no_think mode (a system message with "/no_think", or
# enable_thinking=False): a system turn always first (published: "## Metadata" with the dates and
# reasoning mode, then the custom instructions; here the instructions only), each assistant turn
# opening with an empty thought "<think>\n\n</think>\n". The published default is /think, where the
# generation prompt ends "<|im_start|>assistant\n<think>\n" and an assistant turn is rendered as its
# content alone: a plain answer's rendering does not start with the generation prompt, so
# xla_train.tasks.documents.chat refuses such rows unless the system message says /no_think.
SMOLLM3_TEMPLATE = ("<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
                    "{{ messages[0]['content'].replace('/no_think', '').replace('/think', '').rstrip() }}{% endif %}"
                    "<|im_end|>\n{% for m in messages %}{% if m['role'] == 'user' %}"
                    "<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% elif m['role'] == 'assistant' %}"
                    "<|im_start|>assistant\n<think>\n\n</think>\n{{ m['content'].lstrip('\n') }}<|im_end|>\n"
                    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Phi-4-mini-instruct (tokenizer_config.json, tools left out): <|role|>content<|end|>, and the
# end-of-sequence token after the last turn when there is no generation prompt (so a multi-turn
# rendering does not start with the rendering of its first exchange)
PHI4_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% else %}{{ eos_token }}{% endif %}")
# granite-3.3-2b-instruct (llama.cpp's copy of its template): <|start_of_role|>role<|end_of_role|>
# content<|end_of_text|>; left out: the default system turn the published template adds when
# there is none ("Knowledge Cutoff Date: April 2024. Today's Date: ... You are Granite..."),
# tools, documents and controls
GRANITE_TEMPLATE = ("{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}"
                    "<|end_of_text|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}")
# gpt-oss-20b (harmony; openai/gpt-oss-120b's chat_template.jinja as llama.cpp copies it):
# <|start|>role<|message|>content<|end|>, the assistant's answer in the final channel, and the
# last assistant turn of a training rendering (no generation prompt) ending with <|return|>, not
# <|end|> (so a multi-turn rendering does not start with the rendering of its first exchange).
# Left out: the system message the published template always renders ("You are ChatGPT...",
# knowledge cutoff, date, reasoning effort, channels), "# Instructions" before a developer
# message, thinking (the analysis channel), tools.
HARMONY_TEMPLATE = ("{% if messages[0]['role'] in ('system', 'developer') %}"
                    "<|start|>developer<|message|>{{ messages[0]['content'] }}<|end|>"
                    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
                    "{% for m in loop_messages %}{% if m['role'] == 'assistant' %}"
                    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}"
                    "{{ '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}"
                    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

_GEMMA_TOKENS = {  # gemma-2b's and gemma-2-2b's tokenizer: <pad> 0, <eos> 1, <bos> 2, <unk> 3 (turns: 106, 107)
    "first": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], "last": [],
    "bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>", "adds_bos": True, "template": GEMMA_TEMPLATE,
    "end_of_turn": "<end_of_turn>"}

# family: the checkpoint it stands for, its config.json as published (sizes are replaced by
# `shrunk`, token ids by those of the tokenizer in use), its tokenizer's special tokens (where in
# the vocabulary, which begin, end, pad and stand for unknown text), whether it adds a beginning
# token, its chat template and the token that ends an assistant turn, its model_max_length where
# its tokenizer_config.json sets one, and its generation_config.json (token ids by name).
ZOO = {
    "llama": {
        "checkpoint": "meta-llama/Llama-3.2-1B",
        "config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
                   "attention_dropout": 0.0, "bos_token_id": "<|begin_of_text|>", "eos_token_id": "<|end_of_text|>",
                   "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
                   "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
                   "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
                   "rms_norm_eps": 1e-05,
                   "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                    "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                   "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
                   "vocab_size": 128256},
        # Llama 3's tokenizer: specials after the 128,000 words; no padding token, no unknown one
        # (byte-level); its chat template ends every turn with <|eot_id|>
        "tokens": {"first": [], "last": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                         "<|end_header_id|>", "<|eot_id|>"],
                   "bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": None, "unk": None, "adds_bos": True,
                   "template": LLAMA3_TEMPLATE, "end_of_turn": "<|eot_id|>", "limit": {"model_max_length": 131072}},
        "generation": {"bos_token_id": "<|begin_of_text|>", "do_sample": True, "eos_token_id": "<|end_of_text|>",
                       "temperature": 0.6, "top_p": 0.9},
    },
    "qwen2": {
        "checkpoint": "Qwen/Qwen2.5-0.5B-Instruct",
        "config": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
                   "bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>", "hidden_act": "silu",
                   "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
                   "max_position_embeddings": 32768, "max_window_layers": 21, "num_attention_heads": 14,
                   "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                   "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
                   "use_sliding_window": False, "vocab_size": 151936},
        # q, k and v projections with biases (Qwen2's attention has them whatever the config says);
        # the embedding has more rows (151,936) than the tokenizer has tokens (151,665): `vocab_multiple`
        "vocab_multiple": 64,
        # no beginning token; <|endoftext|> pads; ChatML turns end with <|im_end|>
        "tokens": {"first": [], "last": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos": None,
                   "eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": None, "adds_bos": False,
                   "template": CHATML_TEMPLATE, "end_of_turn": "<|im_end|>", "limit": {"model_max_length": 131072}},
        "generation": {"bos_token_id": "<|endoftext|>", "do_sample": True,
                       "eos_token_id": ["<|im_end|>", "<|endoftext|>"], "pad_token_id": "<|endoftext|>",
                       "repetition_penalty": 1.1, "temperature": 0.7, "top_k": 20, "top_p": 0.8},
    },
    "gemma": {
        "checkpoint": "google/gemma-2b",
        "config": {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "attention_bias": False,
                   "attention_dropout": 0.0, "bos_token_id": "<bos>", "eos_token_id": "<eos>", "head_dim": 256,
                   "hidden_act": "gelu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 16384,
                   "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 18,
                   "num_key_value_heads": 1, "pad_token_id": "<pad>", "rms_norm_eps": 1e-06, "rope_scaling": None,
                   "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256000},
        # multi-query attention (one key/value head); embeddings tied (Gemma's default, not in the file)
        "tokens": _GEMMA_TOKENS,
        "generation": {"bos_token_id": "<bos>", "eos_token_id": "<eos>", "pad_token_id": "<pad>"},
    },
    "gemma2": {
        "checkpoint": "google/gemma-2-2b",
        "config": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
                   "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": "<bos>",
                   "cache_implementation": "hybrid", "eos_token_id": "<eos>", "final_logit_softcapping": 30.0,
                   "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                   "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
                   "max_position_embeddings": 8192, "num_attention_heads": 8, "num_hidden_layers": 26,
                   "num_key_value_heads": 4, "pad_token_id": "<pad>", "query_pre_attn_scalar": 256,
                   "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
                   "use_cache": True, "vocab_size": 256000},
        # layers alternate sliding-window and global attention; heads x head_dim (2048) differs
        # from the width (2304); eager attention (transformers' sdpa has no soft-capping)
        "tokens": _GEMMA_TOKENS,
        "generation": {"bos_token_id": "<bos>", "cache_implementation": "hybrid", "eos_token_id": "<eos>",
                       "pad_token_id": "<pad>"},
    },
    "mistral": {
        "checkpoint": "mistralai/Mistral-7B-v0.1",
        "config": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": "<s>",
                   "eos_token_id": "</s>", "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                   "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
                   "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                   "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
                   "vocab_size": 32000},
        # <unk> 0, <s> 1, </s> 2; no padding token, no chat template (a base model)
        "tokens": {"first": ["<unk>", "<s>", "</s>"], "last": [], "bos": "<s>", "eos": "</s>", "pad": None,
                   "unk": "<unk>", "adds_bos": True, "template": None, "end_of_turn": None},
        "generation": {"bos_token_id": "<s>", "eos_token_id": "</s>"},
    },
    "gpt2": {
        "checkpoint": "openai-community/gpt2",
        "config": {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                   "attn_pdrop": 0.1, "bos_token_id": "<|endoftext|>", "embd_pdrop": 0.1,
                   "eos_token_id": "<|endoftext|>", "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
                   "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1,
                   "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
                   "summary_type": "cls_index", "summary_use_proj": True, "vocab_size": 50257},
        # dropout 0.1 everywhere; learned positions; embeddings tied (GPT-2's default); one special
        # token, <|endoftext|> (50256, the last), for the beginning, the end and the unknown; nothing added
        "tokens": {"first": [], "last": ["<|endoftext|>"], "bos": "<|endoftext|>", "eos": "<|endoftext|>", "pad": None,
                   "unk": "<|endoftext|>", "adds_bos": False, "template": None, "end_of_turn": None,
                   "limit": {"model_max_length": 1024}},
        "generation": {"bos_token_id": "<|endoftext|>", "eos_token_id": "<|endoftext|>"},
    },
}


# The families of late 2026, each from its checkpoint's config.json as published, kept in
# tests/published/FAMILY.json with where it was read (two, OLMo-2's and Granite's, are partly
# reconstructed from a sibling checkpoint's file: their `reconstructed_keys` say which keys), with
# their tokenizers and generation_config.json (LATE_TOKENS). They join the zoo for the attention
# tests (tests/test_attention.py) and test_matrix's zoo-flag and chat-template tests; the whole
# matrix (tests/test_matrix.py) runs FAMILIES.
LATE_2026 = ("qwen3", "gemma3", "smollm3", "phi4mini", "olmo2", "granite", "qwen3moe", "mixtral", "gptoss")
EXPERTS = ("qwen3moe", "mixtral", "gptoss")
# layers a tiny model keeps so that its pattern of layers shows once: Gemma 3's five sliding
# layers and a global one, SmolLM3's three RoPE layers and one without (no_rope_layer_interval 4)
LAYER_PATTERN = {"gemma3": 6, "smollm3": 4}
for _family in LATE_2026:
    ZOO[_family] = json.loads((Path(__file__).parent / "published" / f"{_family}.json").read_text())

# The late families' tokenizers and generation_config.json, as their checkpoints publish them,
# in the older entries' form, with two more keys: "published_ids", the published id of each
# special token named here (their config.json files, kept as published, carry ids: `config`
# reads them as these tokens), and "plain", tokens added after the special ones that are not
# special (Qwen3's <think> and </think>: decoding keeps them). Where each fact was read, and
# what is not verified, is said with it. Ids the tokens spec and the published config share are
# checked against each other by `config` (an id it cannot name fails).
_QWEN3_TOKENS = {  # Qwen3-4B's tokenizer_config.json (the Qwen3 family's tokenizer): no beginning token
    # (bos_token null, add_bos_token false), <|im_end|> ends, <|endoftext|> pads, no unknown token
    # (byte-level); specials after the 151,643 words, then <think> 151667 and </think> 151668,
    # added but not special. Qwen3-0.6B's and Qwen3-30B-A3B's own files not seen: their
    # model_max_length (131072, as Qwen2.5's) is not verified.
    "first": [], "last": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "plain": ["<think>", "</think>"],
    "published_ids": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667,
                      "</think>": 151668},
    "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": None, "adds_bos": False,
    "template": QWEN3_TEMPLATE, "end_of_turn": "<|im_end|>", "limit": {"model_max_length": 131072}}
# Qwen3-0.6B's generation_config.json, verbatim in two copies (a tutorial's json.load of it and a
# training log's GenerationConfig); Qwen3-30B-A3B's not seen (taken as the family's)
_QWEN3_GENERATION = {"bos_token_id": "<|endoftext|>", "do_sample": True,
                     "eos_token_id": ["<|im_end|>", "<|endoftext|>"], "pad_token_id": "<|endoftext|>",
                     "temperature": 0.6, "top_k": 20, "top_p": 0.95}
LATE_TOKENS = {
    "qwen3": {"tokens": _QWEN3_TOKENS, "generation": _QWEN3_GENERATION},
    "qwen3moe": {"tokens": _QWEN3_TOKENS, "generation": _QWEN3_GENERATION},
    "gemma3": {
        # Gemma's tokenizer: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4, <start_of_turn> 105,
        # <end_of_turn> 106 (a GGUF of gemma-3-1b-it: pad 0, eos 1, bos 2, unk 3; its config.json:
        # eos [1, 106]); <bos> added (the template writes bos_token too, as published). eos_token
        # <eos> is from gemma-3-4b's and Gemma 3n's tokenizer_config.json, not the 1b's own (not
        # seen); model_max_length unset there (1e30), so none here.
        "tokens": {"first": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
                   "last": [], "published_ids": {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4,
                                                 "<start_of_turn>": 105, "<end_of_turn>": 106},
                   "bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>", "adds_bos": True,
                   "template": GEMMA3_TEMPLATE, "end_of_turn": "<end_of_turn>"},
        # gemma-3-4b's generation_config.json as several fine-tuning scripts restate it ("the base
        # checkpoint ships do_sample, top_k 64, top_p 0.95"); the 1b-it's own not seen
        "generation": {"bos_token_id": "<bos>", "cache_implementation": "hybrid", "do_sample": True,
                       "eos_token_id": ["<eos>", "<end_of_turn>"], "pad_token_id": "<pad>", "top_k": 64, "top_p": 0.95},
    },
    "smollm3": {
        # Llama 3.2's vocabulary (128,000 words, then specials); its config.json: bos 128000, eos
        # 128012, pad 128004. NOT VERIFIED (SmolLM3's tokenizer_config.json not seen): the names
        # <|im_start|> 128011 and <|im_end|> 128012 (the ChatML markup its template writes; eos =
        # the end of an assistant turn), <think> 128002 and </think> 128003 (special here),
        # <|finetune_right_pad_id|> 128004 (Llama 3.2's name there) as the padding token,
        # <|begin_of_text|> 128000 as bos and not added (its template writes none), no
        # model_max_length.
        "tokens": {"first": [], "last": ["<|begin_of_text|>", "<think>", "</think>", "<|finetune_right_pad_id|>",
                                         "<|im_start|>", "<|im_end|>"],
                   "published_ids": {"<|begin_of_text|>": 128000, "<think>": 128002, "</think>": 128003,
                                     "<|finetune_right_pad_id|>": 128004, "<|im_start|>": 128011, "<|im_end|>": 128012},
                   "bos": "<|begin_of_text|>", "eos": "<|im_end|>", "pad": "<|finetune_right_pad_id|>", "unk": None,
                   "adds_bos": False, "template": SMOLLM3_TEMPLATE, "end_of_turn": "<|im_end|>"},
        # the config's three ids; NOT VERIFIED: the file itself (the model card recommends
        # temperature 0.6 and top_p 0.95; whether the file sets them is not known)
        "generation": {"bos_token_id": "<|begin_of_text|>", "eos_token_id": "<|im_end|>",
                       "pad_token_id": "<|finetune_right_pad_id|>"},
    },
    "phi4mini": {
        # o200k words, <|endoftext|> 199999, then Phi's: <|assistant|> 200019, <|end|> 200020,
        # <|user|> 200021, <|tool|> 200023 (an agent's token handler; <|system|> 200022 between
        # them is inferred, not seen); bos_token <|endoftext|> (quoted from its
        # tokenizer_config.json), eos_token <|endoftext|> (the handler: tokenizer.eos_token_id is
        # <|endoftext|>), the config's pad 199999. NOT VERIFIED: pad_token and unk_token
        # <|endoftext|> in tokenizer_config.json, no beginning token added, model_max_length 131072.
        "tokens": {"first": [], "last": ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"],
                   "published_ids": {"<|endoftext|>": 199999, "<|assistant|>": 200019, "<|end|>": 200020,
                                     "<|user|>": 200021, "<|system|>": 200022},
                   "bos": "<|endoftext|>", "eos": "<|endoftext|>", "pad": "<|endoftext|>", "unk": "<|endoftext|>",
                   "adds_bos": False, "template": PHI4_TEMPLATE, "end_of_turn": "<|end|>",
                   "limit": {"model_max_length": 131072}},
        # eos [200020, 199999], pad and bos 199999: as Phi-4-mini's runtimes and a patch of
        # Phi3ForCausalLM.generate read its generation_config.json (the file itself not seen)
        "generation": {"bos_token_id": "<|endoftext|>", "eos_token_id": ["<|end|>", "<|endoftext|>"],
                       "pad_token_id": "<|endoftext|>"},
    },
    "olmo2": {
        # dolma2 (cl100k words): <|endoftext|> 100257 ends, <|pad|> 100277 pads, no beginning token
        # (OLMo-core's dolma2 TokenizerConfig: eos 100257, pad 100277, bos None; config.json: no
        # bos_token_id). A base model: no chat template. NOT VERIFIED (tokenizer_config.json not
        # seen): bos_token and unk_token <|endoftext|> (as GPT-2's), that there is no chat_template,
        # no model_max_length.
        "tokens": {"first": [], "last": ["<|endoftext|>", "<|pad|>"],
                   "published_ids": {"<|endoftext|>": 100257, "<|pad|>": 100277},
                   "bos": "<|endoftext|>", "eos": "<|endoftext|>", "pad": "<|pad|>", "unk": "<|endoftext|>",
                   "adds_bos": False, "template": None, "end_of_turn": None},
        "generation": {"eos_token_id": "<|endoftext|>", "pad_token_id": "<|pad|>"},  # the config's; file NOT VERIFIED
    },
    "granite": {
        # StarCoder-style: <|end_of_text|> 0 (then <fim_prefix> ... <reponame>, 1-18, left out),
        # the words, <|start_of_role|> 49152, <|end_of_role|> 49153, <|tool_call|> 49154 (then
        # cite and plugin tokens to 49158, left out): granite-io's list of Granite 3.3's special
        # tokens, in order; config.json: bos = eos = pad = 0. <|end_of_text|> ends every turn
        # (and the text, and pads). NOT VERIFIED: unk_token <|end_of_text|>, no beginning token
        # added, no model_max_length.
        "tokens": {"first": ["<|end_of_text|>"], "last": ["<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"],
                   "published_ids": {"<|end_of_text|>": 0, "<|start_of_role|>": 49152, "<|end_of_role|>": 49153,
                                     "<|tool_call|>": 49154},
                   "bos": "<|end_of_text|>", "eos": "<|end_of_text|>", "pad": "<|end_of_text|>",
                   "unk": "<|end_of_text|>", "adds_bos": False, "template": GRANITE_TEMPLATE,
                   "end_of_turn": "<|end_of_text|>"},
        "generation": {"bos_token_id": "<|end_of_text|>", "eos_token_id": "<|end_of_text|>",  # the config's;
                       "pad_token_id": "<|end_of_text|>"},  # file NOT VERIFIED
    },
    "mixtral": {
        # Mistral-7B-v0.1's tokenizer (config.json: bos 1, eos 2): <unk> 0, <s> 1, </s> 2, <s>
        # added, no padding token; a base model: no chat template. Its own tokenizer_config.json
        # and generation_config.json not seen.
        "tokens": {"first": ["<unk>", "<s>", "</s>"], "last": [], "published_ids": {"<unk>": 0, "<s>": 1, "</s>": 2},
                   "bos": "<s>", "eos": "</s>", "pad": None, "unk": "<unk>", "adds_bos": True, "template": None,
                   "end_of_turn": None},
        "generation": {"bos_token_id": "<s>", "eos_token_id": "</s>"},
    },
    "gptoss": {
        # o200k_harmony: 199,998 words, then <|startoftext|> 199998, <|endoftext|> 199999,
        # <|return|> 200002, <|constrain|> 200003, <|channel|> 200005, <|start|> 200006, <|end|>
        # 200007, <|message|> 200008, <|call|> 200012 (reserved ones between, and <|endofprompt|>
        # 200018, left out); bos_token <|startoftext|>, eos_token <|return|>, pad_token
        # <|endoftext|> (its tokenizer_config.json, quoted in a client's source). NOT VERIFIED: no
        # beginning token added (the harmony rendering writes none), no model_max_length.
        "tokens": {"first": [], "last": ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                                         "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"],
                   "published_ids": {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002,
                                     "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
                                     "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012},
                   "bos": "<|startoftext|>", "eos": "<|return|>", "pad": "<|endoftext|>", "unk": None,
                   "adds_bos": False, "template": HARMONY_TEMPLATE, "end_of_turn": "<|return|>"},
        # its generation_config.json as several copies quote it (bos 199998, eos [200002, 199999,
        # 200012], pad 199999, do_sample true)
        "generation": {"bos_token_id": "<|startoftext|>", "do_sample": True,
                       "eos_token_id": ["<|return|>", "<|endoftext|>", "<|call|>"], "pad_token_id": "<|endoftext|>"},
    },
}
for _family, _entry in LATE_TOKENS.items():
    ZOO[_family].update(_entry)


def _shrunk_late(family, size, layers):
    """A late-2026 family's sizes `size` wide: 4 query heads over as many key/value heads as the
    published ratio gives (at least 1), the published head size's share of the width (Qwen3's
    and Gemma 3's heads are wider than width / heads), the MLP and each expert as many times the
    width, 4 experts of which 2 (or the published number, if fewer) per token; per-layer lists
    (layer types, SmolLM3's RoPE layers) cut to the layers kept, Phi-4's per-frequency LongRoPE
    factors to the rotary dimensions kept."""
    c = ZOO[family]["config"]
    layers = max(layers, LAYER_PATTERN.get(family, layers))
    width, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or width // heads
    out = {"hidden_size": size, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": max(1, 4 * c["num_key_value_heads"] // heads),
           "head_dim": max(8, round(head_dim * heads / width * size / 4 / 2) * 2),
           "intermediate_size": int(c["intermediate_size"] / width * size)}
    for key in ("moe_intermediate_size",):
        if key in c:
            out[key] = max(8, int(c[key] / width * size))
    for key in ("num_experts", "num_local_experts"):
        if c.get(key):
            out[key] = 4
    for key in ("num_experts_per_tok", "experts_per_token"):
        if c.get(key):
            out[key] = min(c[key], 2)
    for key in ("layer_types", "no_rope_layers"):
        if c.get(key):
            out[key] = c[key][:layers]
    if c.get("max_window_layers"):
        out["max_window_layers"] = min(c["max_window_layers"], layers)
    scaling = c.get("rope_scaling") or {}
    if "long_factor" in scaling:  # one factor per rotary frequency: head_dim x partial_rotary_factor / 2
        kept = int(out["head_dim"] * c.get("partial_rotary_factor", 1.0)) // 2
        out["rope_scaling"] = {**scaling, "long_factor": scaling["long_factor"][:kept],
                               "short_factor": scaling["short_factor"][:kept]}
    return out


def shrunk(family, size=64, layers=2):
    """The published config's sizes, `size` wide and `layers` deep, in the published proportions:
    as many query heads per key/value head, the MLP as many times the width, Gemma 2's heads x
    head_dim a ninth narrower than the width (2048 of 2304). (`config` scales the random
    initialisation's spread with the width too.)"""
    if family == "gpt2":
        return {"n_embd": size, "n_layer": layers, "n_head": 4}
    if family in LATE_2026:
        return _shrunk_late(family, size, layers)
    heads, kv, head_dim, mlp = {
        "llama": (4, 1, size // 4, 4),  # 32 heads over 8 key/value heads; MLP 4x
        "qwen2": (4, 2, None, 5.4),  # 14 over 2 (7:1 does not divide a small width; 2:1 keeps GQA); MLP 5.4x
        "gemma": (4, 1, size // 4, 8),  # 8 heads over 1 (multi-query); MLP 8x
        "gemma2": (4, 2, (size * 8 // 9) // 4 // 2 * 2, 4),  # 8 over 4; heads x head_dim = 8/9 of the width
        "mistral": (4, 1, None, 3.5),  # 32 over 8; MLP 3.5x
    }[family]
    out = {"hidden_size": size, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
           "intermediate_size": int(mlp * size)}
    if head_dim:
        out["head_dim"] = head_dim
    return out


def _token_ids(values, ids):
    """A config's values with token names replaced by their ids in the tiny vocabulary (`ids`)."""
    def one(v):
        if isinstance(v, list):
            return [ids[x] for x in v]
        return ids[v] if isinstance(v, str) and v in ids else v

    return {k: one(v) if k.endswith("token_id") else v for k, v in values.items()}


def _token_names(values, names):
    """A published config's token ids replaced by the tokens' names (`names`: id -> name); an id
    the family's tokens do not name fails (KeyError)."""
    def one(v):
        if isinstance(v, list):
            return [one(x) for x in v]
        return names[v] if isinstance(v, int) and not isinstance(v, bool) else v

    return {k: one(v) if k.endswith("token_id") else v for k, v in values.items()}


def config(family, vocab, size=64, layers=2, bos=None, eos=None, pad=None, token_ids=None):
    """`family`'s published config shrunk (`shrunk`) over a vocabulary of `vocab` tokens, read by
    transformers as it reads a config.json (legacy keys included). Token ids: the published
    config's tokens by name in `token_ids` (a family tokenizer's vocabulary; a late family's
    published ids are read as the tokens its "published_ids" name), else `bos`, `eos` and `pad`
    (None: no such token)."""
    from transformers import CONFIG_MAPPING

    entry = ZOO[family]
    published = dict(entry["config"])
    # gpt-oss ships its experts in MXFP4; a tiny random model is not quantised
    published.pop("quantization_config", None)
    if token_ids is not None:
        names = {i: name for name, i in entry.get("tokens", {}).get("published_ids", {}).items()}
        published = _token_ids(_token_names(published, names) if names else published, token_ids)
    else:
        published.update({k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad))
                          if k in published or v is not None})
    multiple = entry.get("vocab_multiple", 1)
    published["vocab_size"] = -(-vocab // multiple) * multiple
    published.update(shrunk(family, size, layers))
    # The random initialisation shrinks with the width: the published 0.02 is about 1/sqrt(width)
    # (2048 wide); at 64 wide it would leave a tied embedding too small to learn the task (the
    # tiny Llama learnt nothing in 3 epochs). It sets only the random weights: checkpoints are trained.
    width = entry["config"].get("hidden_size") or entry["config"]["n_embd"]
    published["initializer_range"] = round(entry["config"]["initializer_range"] * (width / size) ** 0.5, 4)
    return CONFIG_MAPPING[published["model_type"]].from_dict(published)


def tokenizer(chat=False):
    """The bundled MiniLM's WordPiece vocabulary as a decoder's tokenizer: it adds [CLS] as the
    beginning of a text and nothing after it; [SEP] ends a sequence; no padding token."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from xla_train.models import bundled_model_path

    raw = Tokenizer.from_file(str(Path(bundled_model_path()) / "tokenizer.json"))
    raw.no_padding()
    raw.no_truncation()
    raw.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 101)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]",
                                  model_max_length=MODEL_MAX_LENGTH)
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def letters_tokenizer(chat=False):
    """A word-level tokenizer of the synthetic task's words only (a 17-token vocabulary): a tiny
    model over it trains in seconds, where the bundled vocabulary's 30,522 logits per token cost
    most of the time."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[CLS]", "[SEP]", *LETTERS, "reverse", "=", "user", "assistant", "system", ":"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]",
                                  model_max_length=MODEL_MAX_LENGTH)
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


# How each family's tokenizer splits text before its BPE merges: a regex then bytes (byte-level
# BPE: Llama 3's, also SmolLM3's (Llama 3.2's vocabulary) and OLMo-2's (dolma2, cl100k's regex);
# Qwen2's, also Qwen3's; o200k's for Phi-4-mini and gpt-oss), GPT-2's bytes (and Granite's,
# StarCoder-style, after splitting digits one by one), or SentencePiece pieces ("▁" for a space:
# Gemma's; Mistral's and Mixtral's, like Llama 2's, with one before the text)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")  # transformers' Qwen2Tokenizer, which AutoTokenizer forces for qwen2
# tiktoken's o200k_base pattern (the ones Phi-4-mini's and gpt-oss's tokenizer.json carry are not
# seen: NOT VERIFIED that they are this one verbatim)
O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
               r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
               r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# family: the regex its byte-level BPE splits with (None: GPT-2's, in ByteLevel itself)
BYTE_LEVEL = {"llama": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "gpt2": None, "qwen3": QWEN2_SPLIT,
              "qwen3moe": QWEN2_SPLIT, "smollm3": LLAMA3_SPLIT, "olmo2": LLAMA3_SPLIT, "phi4mini": O200K_SPLIT,
              "gptoss": O200K_SPLIT, "granite": None}
NFC = ("qwen2", "qwen3", "qwen3moe")  # Qwen's tokenizers normalise to NFC first
SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "mistral", "mixtral")  # the others: byte-level
PREPEND_SPACE = ("mistral", "mixtral")


def _pipeline(family, raw):
    """Sets `family`'s normalizer, pre-tokenizer and decoder on `raw`; returns the BPE's alphabet."""
    import string

    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    chars = list(string.ascii_letters + string.digits + string.punctuation)
    if family in BYTE_LEVEL:
        split = BYTE_LEVEL[family]
        if split is None:
            raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            if family == "granite":  # NOT VERIFIED against granite-3.3's tokenizer.json (not seen)
                raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                             pre_tokenizers.ByteLevel(add_prefix_space=False)])
        else:
            raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
        if family in NFC:
            raw.normalizer = normalizers.NFC()
        raw.decoder = decoders.ByteLevel()
        return chars + ["\u0120", "\u010a"]  # a space and a newline as byte-level characters
    assert family in SENTENCEPIECE, family
    prepend = "first" if family in PREPEND_SPACE else "never"
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", behavior="isolated"),
                                                 pre_tokenizers.Metaspace(prepend_scheme=prepend)])
    raw.decoder = decoders.Metaspace(prepend_scheme=prepend)
    return chars + ["\u2581", "\n"]


# words a family's template writes besides the roles: gpt-oss's channel and developer role
TEMPLATE_WORDS = {"gptoss": ["final", "developer"]}


def _corpus(family=None):
    """What the tiny tokenizers learn their merges from: the synthetic task's rows and the words
    of the chat templates (and `family`'s TEMPLATE_WORDS), each a token of its own once merged."""
    lines = []
    for row in reverse_rows(64, 0):
        answer = row["completion"].strip()
        lines += [row["prompt"] + row["completion"], f"user\n{row['prompt']}", f"user\n\n{row['prompt']}",
                  f"assistant\n{answer}", f"assistant\n\n{answer}", f"model\n{answer}", "system\n:"]
    return lines + TEMPLATE_WORDS.get(family, [])


def family_tokenizer(family, corpus=()):
    """A tiny tokenizer of `family`'s kind (byte-level BPE, or BPE over SentencePiece pieces for
    Gemma's, Mistral's and Mixtral's), its merges learnt from the synthetic task (each of its
    words one token) and the texts of `corpus`, with the family's special tokens at their ends of
    the vocabulary (Gemma's, Mistral's, Mixtral's and Granite's <|end_of_text|> first, the others
    last, then Qwen3's tokens that are added but not special), whether it adds a beginning token,
    which tokens begin, end, pad and stand for unknown text, its length limit and its chat
    template, shaped like the published one."""
    from tokenizers import AddedToken, Tokenizer, models, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = ZOO[family]["tokens"]
    raw = Tokenizer(models.BPE(unk_token=spec["unk"] if family in SENTENCEPIECE else None))
    alphabet = _pipeline(family, raw)
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=spec["first"], initial_alphabet=alphabet,
                                  show_progress=False)
    raw.train_from_iterator([*_corpus(family), *corpus], trainer)
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*spec["first"], *spec["last"])])
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.get("plain", [])])
    if spec["adds_bos"]:
        raw.post_processor = processors.TemplateProcessing(single=f"{spec['bos']} $A",
                                                           special_tokens=[(spec["bos"], raw.token_to_id(spec["bos"]))])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, **{f"{k}_token": spec[k] for k in ("bos", "eos", "pad", "unk")
                                                           if spec[k]}, **spec.get("limit", {}))
    if spec["template"]:
        tok.chat_template = spec["template"]
    return tok


def save(family, path, chat=False, seed=0, letters=False, own_tokens=False, **size):
    """A tiny random `family` decoder and its tokenizer in `path` (the bundled vocabulary, with
    `letters` the synthetic task's, with `own_tokens` the task's words and the family's own
    special tokens and chat template, and its generation_config.json); returns the path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    if own_tokens:
        tok = family_tokenizer(family)
        ids = tok.get_vocab()
        cfg = config(family, len(tok), token_ids=ids, **size)
    else:
        tok = letters_tokenizer(chat) if letters else tokenizer(chat)
        cfg = config(family, len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id, **size)
    model = AutoModelForCausalLM.from_config(cfg)
    if own_tokens:
        model.generation_config = GenerationConfig(**_token_ids(ZOO[family]["generation"], ids))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def reverse_rows(n, seed, form="prompt/completion"):
    """`n` rows of the synthetic task: a list of 3-5 distinct letters and the list reversed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        letters = rng.sample(LETTERS, rng.randint(3, 5))
        prompt, answer = "reverse " + " ".join(letters) + " =", " ".join(reversed(letters))
        if form == "messages":
            rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
        elif form == "text":
            rows.append({"text": f"{prompt} {answer}"})
        else:
            rows.append({"prompt": prompt, "completion": " " + answer})
    return rows


def trained_runs(ids, trained):
    """The stretches of a document's token ids whose labels are trained, in order."""
    runs, run = [], []
    for i, t in zip(ids, trained):
        if t:
            run.append(i)
        elif run:
            runs, run = runs + [run], []
    return runs + ([run] if run else [])


def write_jsonl(path, rows):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


def scaled_llama_step(checkpointed, chunked, rows=1, length=512, chunk=128):
    """A Llama-shaped model (4 blocks, 256 wide, GQA, the bundled vocabulary's 30,522 words, tied)
    and one fp32 training step on the CPU as the causal-LM task runs it (sdpa, a packed row's
    boolean 4-D mask, the head whole or in chunks of `chunk` tokens): the model, its memory plan (memory.Plan),
    and the step (tests/test_memory.py and benchmarks/bench_memory.py --measure measure its peak)."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from xla_train.core.engine import checkpoint_activations
    from xla_train.kernels.attention import document_mask
    from xla_train.kernels.lm_loss import chunked_lm_loss
    from xla_train.memory import plan, shape_of
    from xla_train.parallel.mesh import Mesh
    from xla_train.tasks.base import PassInputs

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=30522, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
                      use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).train()
    if checkpointed:
        checkpoint_activations(model)
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, cfg.vocab_size, (rows, length), generator=g) for _ in range(2))
    segments = torch.ones(rows, length, dtype=torch.long)
    segments[:, length // 3:] = 2  # two documents a row
    mask = document_mask(segments)

    def step():
        if chunked:
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            loss_sum, tokens = chunked_lm_loss(hidden, model.lm_head.weight, labels, chunk_tokens=chunk)
            loss = loss_sum.sum() / tokens.sum()
        else:
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        for p in model.parameters():
            p.grad = None

    memory = plan(Mesh(), PassInputs("sdpa", dense_mask=True, logits="chunked" if chunked else "whole", length=length,
                                     rows=rows, checkpointed=checkpointed, chunk_tokens=chunk), shape_of(model))
    return model, memory, step
