"""Tiny random decoders for the causal-LM tests and benchmarks: Llama, Qwen2, Gemma, Mistral and
GPT-2 built from their configs, with the bundled WordPiece vocabulary as a decoder's tokenizer (a
beginning token, an end-of-sequence token and no padding token; optionally a chat template), and
a synthetic task a tiny model learns in minutes: reversing a short list of letters."""

import json
import random
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [SEP] {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
FAMILIES = ("llama", "qwen2", "gemma", "mistral", "gpt2")
LETTERS = "abcdefgh"


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
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]")
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
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="[CLS]", eos_token="[SEP]", unk_token="[UNK]")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def config(family, vocab, size=64, layers=2, bos=None, eos=None):
    from transformers import GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=size, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=2 * size, max_position_embeddings=512,
                  pad_token_id=None, bos_token_id=bos, eos_token_id=eos)
    if family == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=size, n_layer=layers, n_head=4, n_positions=512, bos_token_id=bos,
                          eos_token_id=eos)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma": GemmaConfig,
            "mistral": MistralConfig}[family](**common, **({"head_dim": size // 4} if family == "gemma" else {}))


def save(family, path, chat=False, seed=0, letters=False, **size):
    """A tiny random `family` decoder and its tokenizer in `path` (the bundled vocabulary, or with
    `letters` the synthetic task's); returns the path."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = letters_tokenizer(chat) if letters else tokenizer(chat)
    torch.manual_seed(seed)
    cfg = config(family, len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id, **size)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
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


def write_jsonl(path, rows):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)
