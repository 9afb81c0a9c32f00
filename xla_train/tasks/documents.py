"""A causal LM's rows as documents: the three forms of a row (TRL's SFTTrainer takes the same),
each tokenised to token ids and, per token, whether the loss covers it; and a prompt's ids for
generation, tokenised as training tokenised its prompts. Kinds that train decoders share it.

    messages             chat turns [{role, content}, ...] rendered with the tokenizer's chat
                         template; the loss covers the assistant turns
    prompt, completion   the loss covers the completion and its end-of-sequence token
    text                 the loss covers every token
"""

from ..core.errors import UserError
from .base import row_name

FORMS = {"messages": ("messages",), "prompt/completion": ("prompt", "completion"), "text": ("text",)}
IGNORE = -100  # labels the loss skips (torch's cross_entropy ignore_index, transformers' convention)
SOURCE_ROW = "_source_row"  # a held-out split's rows: their position in the file, for messages


def form_of(ds, path):
    """Which of FORMS a split's columns make; one line naming the forms if none."""
    for form, columns in FORMS.items():
        if all(c in ds.column_names for c in columns):
            return form
    raise UserError(f"{path}: rows need a 'messages' column (chat turns), 'prompt' and 'completion' columns, or a "
                    f"'text' column (columns: {', '.join(ds.column_names)})")


def documents(ds, form, tokenizer, max_length, path):
    """Each row as (input_ids, labels): labels shifted (a token's label is the next token, where
    that one is trained; IGNORE elsewhere), truncated to `max_length` tokens. Returns (documents,
    truncated count, count left out for having no trained token within the length)."""
    from tqdm.auto import tqdm

    if form == "messages" and not tokenizer.chat_template:
        raise UserError(f"{path}: messages need a chat template, and the model's tokenizer has none; use "
                        "prompt/completion or text rows, or a model whose tokenizer has a chat_template")
    rows = ds.to_list() if len(ds) < 2_000 else ds  # a large split is read row by row
    docs, truncated, empty = [], 0, 0
    for i, row in enumerate(tqdm(rows, desc="Tokenising", disable=len(ds) < 50_000, leave=False)):
        where = f"{path}: {row_name(path, row.get(SOURCE_ROW, i))}"
        ids, trained = encode(row, form, tokenizer, where)
        if len(ids) > max_length:
            ids, trained, truncated = ids[:max_length], trained[:max_length], truncated + 1
        labels = [t if keep else IGNORE for t, keep in zip(ids[1:], trained[1:])] + [IGNORE]
        if all(label == IGNORE for label in labels):
            empty += 1
            continue
        docs.append((ids, labels))
    return docs, truncated, empty


def encode(row, form, tokenizer, where):
    """A row's token ids and, per token, whether the loss covers it."""
    eos = tokenizer.eos_token_id
    if form == "text":
        ids = tokenizer(_string(row["text"], "text", where))["input_ids"]
        ids = ids if ids and ids[-1] == eos else ids + [eos]
        return ids, [True] * len(ids)
    if form == "prompt/completion":
        prompt = tokenizer(_string(row["prompt"], "prompt", where))["input_ids"]
        completion = _string(row["completion"], "completion", where)
        if not completion.strip():
            raise UserError(f"{where}: empty completion")
        answer = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos]
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)
    return chat(row["messages"], tokenizer, where)


def prompt_ids(row, form, tokenizer, where):
    """A prompt's token ids for generation (`form`: "prompt" or "messages"), tokenised as training
    tokenised its prompts: a prompt with the tokenizer's special tokens (encode), a conversation
    rendered by the chat template with the generation prompt after its last turn (chat)."""
    if form == "prompt":
        return tokenizer(_string(row["prompt"], "prompt", where))["input_ids"]
    text = tokenizer.apply_chat_template(_turns(row["messages"], where), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _turns(messages, where):
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise UserError(f"{where}: 'messages' must be a list of turns, each {{\"role\": ..., \"content\": ...}} "
                        f"with text content; found {str(messages)[:80]!r}")
    return messages


def chat(messages, tokenizer, where):
    """A conversation rendered with the chat template; the assistant turns are the characters
    each one adds to the rendering of the turns before it with the generation prompt (so their
    end-of-turn markup is trained, and the prompt's markup is not). Where the template renders a
    turn otherwise once later turns follow it (Qwen3's empty thinking on the last turn only,
    gpt-oss's <|return|> against <|end|>, Phi-4's end-of-sequence after the last turn), the turn
    is its content found in the rendering after the turns before it, and the special token that
    follows it (its end of turn)."""
    messages = _turns(messages, where)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise UserError(f"{where}: no assistant turn (roles: {', '.join(m['role'] for m in messages)})")

    def render(upto, prompt=False):
        if not upto:
            return ""
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt)

    text, spans = render(len(messages)), []
    for i in turns:
        start, end = render(i, prompt=True), render(i + 1)
        if text.startswith(start) and text.startswith(end) and len(end) > len(start):
            spans.append((len(start), len(end)))
            continue
        after = max(spans[-1][1] if spans else 0, len(start) if text.startswith(start) else 0)
        content = messages[i]["content"].strip() if isinstance(messages[i]["content"], str) else ""
        at = text.find(content, after) if content else -1
        if at < 0:
            raise UserError(f"{where}: the chat template does not render earlier turns as the start of later ones, "
                            f"and assistant turn {i + 1}'s text is not in the rendering after them, so the assistant "
                            "turns cannot be found in it")
        stop = at + len(content)
        ends = [t for t in _special_tokens(tokenizer) if text.startswith(t, stop)]
        spans.append((at, stop + max(map(len, ends), default=0)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
    return enc["input_ids"], trained


def _special_tokens(tokenizer):
    """The tokenizer's special tokens as text (an end of turn among them)."""
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]


def _string(value, column, where):
    if not isinstance(value, str):
        raise UserError(f"{where}: '{column}' must be text, found {type(value).__name__} {str(value)[:40]!r}")
    return value
