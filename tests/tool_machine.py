"""A tiny decoder that calls tools on cue, for the tool loop's tests (tests/test_tools.py).

A random model seldom writes a well-formed tool call, and a taught one takes minutes to teach. This
one is a real transformers Qwen2 decoder whose weights are set so that it follows a script: its
attention and MLP outputs are zero (every layer passes its input on), so each next token depends on
the current token only, and its untied head maps chosen tokens to chosen next tokens (`script`,
{token: {next token: logit}}; several next tokens: a draw between them at sampling time). Whole
tool calls are single tokens of its tokenizer (Qwen2's byte-level kind, `family_tokenizer`), so
`CALL` then `<|im_end|>` is a complete, well-formed call of `multiply(12, 13)`.

The chat template (`TOOL_TEMPLATE`) is ChatML with tools as Qwen2.5's renders them (a system turn
listing the tools, calls as <tool_call> JSON, results as a user turn's <tool_response>), without its
long default system text and with the tools' names only (a short prompt); `RESPONSE_TEMPLATE`
parses calls as Qwen's response template does."""

import tiny_decoders as td

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %} {{ t['function']['name'] }}{% endfor %}</tools>"
    "<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
    "fields": {"tool_calls": {"open": "<tool_call>", "close_pattern": "</tool_call>\\s*", "repeats": True,
                              "content": "json", "transform": {"type": "function", "function": "{content}"}},
               "content": {"close_pattern": "<\\|im_end\\|>\\s*", "content": "text"}}}
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 13}}\n</tool_call>'
FAILING = '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>'
MALFORMED = '<tool_call>\n{"name": "multiply", "argum\n</tool_call>'
ANSWER = "The product is 156."
WORDS = (CALL, FAILING, MALFORMED, ANSWER)


def tokenizer():
    """Qwen2's tiny byte-level tokenizer with the tool template, the response template and the
    script's words as single tokens."""
    from tokenizers import AddedToken

    tok = td.family_tokenizer("qwen2")
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in WORDS])
    tok.chat_template = TOOL_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def model(tok, script, seed=0):
    """A tiny Qwen2 that follows `script` ({token text: {next token text: logit}}), in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = td.config("qwen2", len(tok), token_ids=tok.get_vocab(), layers=1)
    cfg.tie_word_embeddings = False
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = m.lm_head.weight
        head.zero_()
        for word, nexts in script.items():
            u = tok.convert_tokens_to_ids(word) if word in tok.get_vocab() else tok(word)["input_ids"][-1]
            h = m.model.norm(m.model.embed_tokens.weight[u])
            for nxt, logit in nexts.items():
                head[tok.convert_tokens_to_ids(nxt)] += logit * h / h.pow(2).sum()
    return m


def save(folder, script, seed=0):
    """The scripted model and its tokenizer in `folder` (--model)."""
    tok = tokenizer()
    model(tok, script, seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
