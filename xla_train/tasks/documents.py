"""A causal LM's rows as documents: the three forms of a row (TRL's SFTTrainer takes the same),
each tokenised to token ids and, per token, whether the loss covers it; and a prompt's ids for
generation, tokenised as training tokenised its prompts. Kinds that train decoders share it.

    messages             chat turns [{role, content}, ...] rendered with the tokenizer's chat
                         template; the loss covers the assistant turns (their tool calls too)
    prompt, completion   the loss covers the completion and its end-of-sequence token
    text                 the loss covers every token

Messages may come with a `tools` column (TRL's SFT form of tool-calling traces): the tools' JSON
schemas, as a JSON string or a list, handed to the chat template (`tools=`); the turns may then
hold assistant `tool_calls` and `tool` turns (the tools' results, not trained).
"""

import json
import re

from ..core.errors import UserError
from .base import row_name

FORMS = {"messages": ("messages",), "prompt/completion": ("prompt", "completion"), "text": ("text",)}
TOOLS = "tools"  # messages' optional column: the tools' JSON schemas (TRL's SFTTrainer reads it so)
TRL_EXTRA = "pip install 'xla-train[agents]'"  # setup.py's extra that brings TRL's training chat templates
IGNORE = -100  # labels the loss skips (torch's cross_entropy ignore_index, transformers' convention)
SOURCE_ROW = "_source_row"  # a held-out split's rows: their position in the file, for messages


def form_of(ds, path):
    """Which of FORMS a split's columns make; one line naming the forms if none."""
    for form, columns in FORMS.items():
        if all(c in ds.column_names for c in columns):
            if TOOLS in ds.column_names and form != "messages":
                raise UserError(f"{path}: a '{TOOLS}' column goes with 'messages' rows (chat turns with tool calls); "
                                f"these are {form} rows")
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
    return chat(row["messages"], tokenizer, where, tools_of(row, where))


def prompt_ids(row, form, tokenizer, where):
    """A prompt's token ids for generation (`form`: "prompt" or "messages"), tokenised as training
    tokenised its prompts: a prompt with the tokenizer's special tokens (encode), a conversation
    rendered by the chat template with the generation prompt after its last turn (chat), and with
    the row's tools where it has a `tools` column."""
    if form == "prompt":
        return tokenizer(_string(row["prompt"], "prompt", where))["input_ids"]
    text = _render(tokenizer, _turns(row["messages"], where), tools_of(row, where), where, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tools_of(row, where):
    """A row's tools (its `tools` column: JSON schemas, as a JSON string or a list), or None (an
    empty cell: a row without tools beside rows with them)."""
    tools = row.get(TOOLS)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: '{TOOLS}' is not JSON ({e.msg} at character {e.pos})") from None
    if tools and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UserError(f"{where}: '{TOOLS}' must be a list of the tools' JSON schemas (or that list as a JSON "
                        f"string); found {str(tools)[:80]!r}")
    return tools or None


def _turns(messages, where):
    """The turns, checked: each a role and text content (None for an assistant turn that only
    calls tools, taken as "")."""
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls")))
            for m in messages)):
        raise UserError(f"{where}: 'messages' must be a list of turns, each {{\"role\": ..., \"content\": ...}} "
                        f"with text content; found {str(messages)[:80]!r}")
    return [m if m["content"] is not None else {**m, "content": ""} for m in messages]


def _render(tokenizer, messages, tools, where, **kwargs):
    """The chat template's text of `messages` (with `tools`); a template that refuses the turns
    (raise_exception: roles that must alternate, a tool role it does not know) is one line."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except TemplateError as e:
        raise UserError(f"{where}: the chat template refuses these turns: {e}") from None


def chat(messages, tokenizer, where, tools=None):
    """A conversation (with `tools`, its tools' schemas) rendered with the chat template, and per
    token whether the loss covers it: the assistant turns' (their tool calls included), not the
    user's, system's or tools' turns. An assistant turn is the characters it adds to the rendering
    of the turns before it with the generation prompt (so its end-of-turn markup is trained, and
    the prompt's markup is not). Where the template renders a turn otherwise once later turns
    follow it (Qwen3's empty thinking on the last turn only, gpt-oss's <|return|> against <|end|>,
    Phi-4's end-of-sequence after the last turn), a turn with text and no tool call is its content
    found in the rendering after the turns before it, and the special token that follows it (its
    end of turn). A turn neither finds (Qwen3's tool calls, rendered with no thinking once a tool's
    result follows) is found, with every other, by the template's {% generation %} markers (TRL's
    way): the tokenizer's own template's, or TRL's training template for the family (`marked`)."""
    messages = _turns(messages, where)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise UserError(f"{where}: no assistant turn (roles: {', '.join(m['role'] for m in messages)})")

    def render(upto, prompt=False):
        if not upto:
            return ""
        return _render(tokenizer, messages[:upto], tools, where, add_generation_prompt=prompt)

    text, spans = render(len(messages)), []
    check_tools_rendered(text, messages, tools, where)
    for i in turns:
        start, end = render(i, prompt=True), render(i + 1)
        if text.startswith(start) and text.startswith(end) and len(end) > len(start):
            spans.append((len(start), len(end)))
            continue
        after = max(spans[-1][1] if spans else 0, len(start) if text.startswith(start) else 0)
        content = messages[i]["content"].strip()
        at = text.find(content, after) if content and not messages[i].get("tool_calls") else -1
        if at < 0:
            return marked(messages, tools, tokenizer, where, i)
        stop = at + len(content)
        ends = [t for t in _special_tokens(tokenizer) if text.startswith(t, stop)]
        spans.append((at, stop + max(map(len, ends), default=0)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    trained = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
    return enc["input_ids"], trained


def marked(messages, tools, tokenizer, where, turn):
    """The conversation's tokens and its assistant turns' mask from the {% generation %} markers
    of the tokenizer's template, or, without them, of TRL's training template for its family
    (`trl.chat_template_utils.get_training_chat_template`: the family's template rendering earlier
    turns as later ones see them, with the markers; TRL's SFTTrainer takes it for
    assistant_only_loss). `turn`: the assistant turn the prefix rule could not find, for the error."""
    template = tokenizer.chat_template
    if not has_generation_markers(template):
        template = _training_template(tokenizer, where, turn)
    out = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    if not any(out["assistant_masks"]):
        raise UserError(f"{where}: the chat template's {{% generation %}} markers enclose no assistant turn")
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def has_generation_markers(template):
    """Whether a chat template marks its assistant turns with {% generation %} (trimmed or not),
    as transformers' return_assistant_tokens_mask reads them."""
    return isinstance(template, str) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


_TRAINING_TEMPLATES: dict[str, str] = {}  # a chat template: TRL's training template for it (checked once)


def _training_template(tokenizer, where, turn):
    template = tokenizer.chat_template
    key = str(template)  # a template shipped as named variants is a dict
    if key in _TRAINING_TEMPLATES:
        return _TRAINING_TEMPLATES[key]
    refused = (f"{where}: the chat template does not render earlier turns as the start of later ones, and assistant "
               f"turn {turn + 1} cannot be found in the rendering after them")
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        raise UserError(f"{refused}; TRL's training chat template of the family finds it ({TRL_EXTRA})") from None
    try:  # None only for a template with markers, which `marked` reads itself
        training = get_training_chat_template(tokenizer) or template
    except ValueError:
        raise UserError(f"{refused}, and TRL has no training chat template for it: mark the assistant turns in the "
                        "template with {% generation %} ... {% endgeneration %}") from None
    _TRAINING_TEMPLATES[key] = training
    return training


def check_tools_rendered(text: str, messages: list, tools: list | None, where: str) -> None:
    """The tools' names, the tool calls' names and arguments and the tools' results are in the
    rendering: a template without tools (one that prints only each turn's content) renders none of
    them. The traces' rule, and --tools' at the start (tasks/tools.py)."""
    wanted = [t.get("function", t).get("name") for t in tools or ()]
    for m in messages:
        for call in (c.get("function") or c for c in m.get("tool_calls") or () if isinstance(c, dict)):
            arguments = call.get("arguments")  # a dict's keys and values (a JSON string is rendered as it is)
            wanted += [call.get("name"), *(map(str, [*arguments, *arguments.values()]) if isinstance(arguments, dict)
                                           else ())]
        wanted += [m["content"].strip()] if m["role"] == "tool" else []
    missing = next((w for w in wanted if isinstance(w, str) and w and w not in text), None)
    if missing is not None:
        raise UserError(f"{where}: the chat template does not render tools ({missing[:40]!r} is not in its "
                        "rendering); give a model whose chat template renders tool calls and tool turns (Qwen3's, "
                        "for one)")


def _special_tokens(tokenizer):
    """The tokenizer's special tokens as text (an end of turn among them)."""
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]


def _string(value, column, where):
    if not isinstance(value, str):
        raise UserError(f"{where}: '{column}' must be text, found {type(value).__name__} {str(value)[:40]!r}")
    return value
