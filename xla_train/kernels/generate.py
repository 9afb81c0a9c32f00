"""Text generation from a decoder, one left-padded batch of prompts at a time.

Where every new shape compiles (XLA), `static_generate` generates over fixed-size key/value caches
(`Slots`: a full-attention layer's holds the whole row, a sliding layer's a ring of its window and
a chunk less one where that is shorter): the prompt's forward pass (prefill) is one graph and
each one-token step (decode) another, the same for every step and every batch of a bucket length,
so a run compiles about two graphs per bucket whatever the number of prompts or tokens. Nothing is
read on the host per token: each row's `done` flag, its next position and the tokens so far stay
on the device, and the graph is cut after every token. Every row takes all `max_new_tokens` steps
(a row that ended feeds padding). Elsewhere `eager_generate` is transformers' `generate`.
`static_generate` is the one-turn case of `Turns`, the generation that stops for tool results
and resumes in the same cache (GRPO with tools).

Both return a (rows, max_new_tokens) tensor of token ids: the generated tokens, the first
end-of-sequence token, then padding.
"""

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, StaticLayer

from ..core.errors import UserError
from ..core.inference import predict_rows
from .attention import document_mask, eager_attention, layer_windows, mask_for


@dataclass
class Sampling:
    """How tokens are chosen: greedy (temperature 0) or sampled with a temperature, top-p and
    top-k (0: every token)."""

    max_new_tokens: int
    eos_ids: tuple  # any of these ends a row
    pad_id: int  # what a row that ended emits
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self):
        return self.temperature == 0


def pick(logits, sampling):
    """The next token of each row from its last logits (rows, vocabulary): the argmax, or a sample
    drawn with the Gumbel-max trick (the argmax of logits / temperature plus Gumbel noise) on the
    device, from the top-k likeliest tokens (where top-k is set), then the smallest set of likeliest
    tokens whose probability reaches top-p (transformers' order: TopKLogitsWarper, then TopPLogitsWarper)."""
    if sampling.greedy:
        return logits.argmax(-1)
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:  # a static k: the graph keeps its shape
        kth = logits.topk(sampling.top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    order = None
    if sampling.top_p < 1:
        logits, order = logits.sort(-1, descending=True)
        probs = logits.softmax(-1)
        # a token is dropped once the likelier ones before it hold top-p (the first is always kept),
        # as transformers' TopPLogitsWarper keeps them
        logits = logits.masked_fill(probs.cumsum(-1) - probs >= sampling.top_p, float("-inf"))
    uniform = torch.rand_like(logits).clamp(min=torch.finfo(torch.float32).tiny)
    chosen = (logits - torch.log(-torch.log(uniform))).argmax(-1)
    return chosen if order is None else order.gather(-1, chosen[:, None])[:, 0]


def drawn_logp(logits, token, sampling):
    """Each row's log-probability of `token` under its `logits` (rows, vocabulary) divided by the
    temperature, fp32 (rows, 1): the distribution the token was drawn from, which GRPO's loss takes."""
    return (logits.float() / sampling.temperature).log_softmax(-1).gather(-1, token[:, None])


TURN_CHUNK = 16  # tokens appended between turns are fed in chunks of this many (Turns)


class Slots(StaticLayer):
    """One layer's key/value cache of `size` slots on the device (`slots_of`): the row's token t at
    slot t % size. A full-attention layer's size is the whole row (prompt + new tokens: it never
    wraps); a sliding layer's, where shorter, its window and a chunk less one: a ring that holds
    at least the last `window` tokens, those the window rule keeps (q - k < window,
    kernels.attention.document_mask), in any order (attention does not depend on the keys'
    order; their positions are in them already, and each slot's mask is read from the position of
    the token it holds: Turns' `held`), and in which a chunk's first query still sees the window
    before it once the chunk's last token is written.

    The first call (the prompt's pass) writes every row's prompt at the same slots and attends to
    its own keys and values only, so a prompt longer than the ring attends within itself under the
    windowed mask. Every later call writes at each row's own slots, as rows advance by different
    counts (one row's tool result is longer, another row has ended): `plan[size]` (set by `Turns`
    before each call) holds each row's slots for the call's tokens and which of them to write;
    the others keep what they hold (a row that waits writes nothing). A call's slots are
    consecutive for each row and at most a chunk of them, so no two of a row's writes meet in one
    call; it attends to all the slots.

    Why a ring: a full-row cache with a windowed mask would be exact too, but holds and reads
    prompt + new tokens slots in every sliding layer (Gemma 3's five of six). Why not transformers'
    own (5.24's cache_utils.StaticSlidingWindowLayer, `window` slots): it branches on a host
    counter, writing at a device index until the window fills and rolling the whole cache by one
    slot after, so a rollout that crosses the window would compile a second decode graph; the
    ring writes at device indices, one graph."""

    def __init__(self, size: int, plan: dict) -> None:
        super().__init__(max_cache_len=size)
        self.plan = plan
        self.prefilled = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefilled:
            at, write = self.plan[self.max_cache_len]  # [rows, new] slots, [rows, new] bool
            index = at[:, None, :, None].expand_as(key_states)
            keep = write[:, None, :, None]
            self.keys.scatter_(2, index, torch.where(keep, key_states, self.keys.gather(2, index)))
            self.values.scatter_(2, index, torch.where(keep, value_states, self.values.gather(2, index)))
            return self.keys, self.values
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        kept = min(new, self.max_cache_len)  # a prompt longer than the ring: its last `size` tokens
        at = torch.arange(new - kept, new, device=self.device) % self.max_cache_len  # the first write: from slot 0
        self.keys.index_copy_(2, at, key_states[:, :, new - kept:])
        self.values.index_copy_(2, at, value_states[:, :, new - kept:])
        self.cumulative_length.add_(new)
        self.prefilled = True
        return key_states, value_states

    def repeat_rows(self, group: int, split_rows: Any = None) -> None:
        """Each row's keys and values `group` times in a row (after the pass over one copy of each
        prompt), laid out by `split_rows` (`prefill`'s); nothing for a layer the pass did not write
        (one that reads another's keys and values: Gemma 3n's and Gemma 4's shared layers)."""
        if not self.is_initialized:
            return
        # index_select, not repeat_interleave: torch_xla makes the latter a view of an expanded
        # tensor, and the decode step's in-place writes into a view would make it another graph
        rows = torch.arange(self.batch_size, device=self.keys.device).repeat_interleave(group)
        for name in ("keys", "values"):  # StaticLayer's own attributes, made by lazy_initialization
            copied = getattr(self, name).index_select(0, rows)
            setattr(self, name, copied if split_rows is None else split_rows(copied))
        self.batch_size *= group


def slots_of(window: int | None, length: int, chunk: int = TURN_CHUNK) -> int:
    """A layer's key/value cache slots (`Slots`) for rows of `length` tokens (prompt + new): the
    row, or where the layer's sliding window (None: none shorter than the row) and a chunk less
    one are shorter, those."""
    return length if window is None else min(window + chunk - 1, length)


def cache_slots(config, length: int) -> list[int]:
    """Each layer's key/value cache slots (`slots_of`) for rows of `length` tokens (prompt + new).
    The memory plan counts them."""
    windows = layer_windows(config, length)
    types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
    return [slots_of(windows[t], length) for t in types]


def check_layer_types(config: Any) -> None:
    """Generation with static shapes serves full and sliding-window attention layers: others refused."""
    other = set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    if other:
        raise UserError(f"generation with static shapes serves full and sliding-window attention layers; the model "
                        f"has {', '.join(sorted(other))} layers")


def masks_by_type(masks: dict, windows: dict, eager: bool) -> Any:
    """The model's `attention_mask` from one boolean mask per window: one 4-D mask where every layer
    takes the same, else a dict by layer type (transformers 5.24 takes either as given:
    masking_utils._preprocess_mask_arguments, and Gemma 2/3's and gpt-oss's `causal_mask_mapping`).
    Eager attention adds it to its scores: a bias, as document_mask(eager=True) makes one."""
    masks = {w: mask_for(m, eager) for w, m in masks.items()}
    if len(masks) == 1:
        return next(iter(masks.values()))
    return {t: masks[w] for t, w in windows.items()}


def prefill(model, input_ids, attention_mask, cache, windows, eager, group=1, split_rows=None):
    """The prompt's pass into `cache` (one `Slots` a layer): the last position's logits of every row
    and each token's position (from 0 at its prompt's first token). It attends within the prompt:
    its tokens one segment and its padding another (padding attends to earlier padding, so no row
    of a mask is empty: an empty one gives NaN, which would reach the real tokens through the
    padding's keys and values), each window's mask by the window rule. Left padding keeps a row's
    tokens in consecutive slots, so slot differences are position differences. `windows`: the
    model's (layer_windows); `eager`: its attention takes masks as biases. `group`: the rows come
    in runs of `group` copies of one prompt (GRPO's completions of a prompt): the pass runs on the
    first of each run and its keys, values and logits are copied to the others (the prompt's work
    once, not `group` times). `split_rows`: lays the copies out as the batch's rows are
    (Strategy.split_rows: under SPMD the partitioner would otherwise keep them whole on every device,
    and every later step would run every row on every device)."""
    segments = attention_mask.long()
    positions = (segments.cumsum(1) - 1).clamp(min=0)
    one = slice(None, None, group)
    masks = {w: document_mask(segments[one], window=w) for w in set(windows.values())}
    logits = model(input_ids=input_ids[one], attention_mask=masks_by_type(masks, windows, eager),
                   position_ids=positions[one], cache=cache, use_cache=True, **_logits_to_keep(model)).logits[:, -1:]
    if group > 1:
        for layer in cache.layers:
            layer.repeat_rows(group, split_rows)
        logits = logits.repeat_interleave(group, 0)
        logits = logits if split_rows is None else split_rows(logits)
    return logits, positions


def static_generate(model, input_ids, attention_mask, sampling, cut_graph, logps=False, stop_when_done=False,
                    group=1, split_rows=None):
    """Generates from a batch of left-padded prompts with static shapes; `cut_graph()` ends the
    pending graph (see the module docstring). `logps`: also each token's log-probability as the
    decode graph gave it, fp32 (rows, max_new_tokens), under the logits divided by the temperature
    (the distribution GRPO's loss takes; 0 after a row ended): returns (tokens, logps).
    `stop_when_done`: the loop stops once every row has ended, as transformers' `generate` does
    (a host read of `done` per token: for devices that run eagerly, where the steps left would
    only write padding; XLA keeps the fixed count, which needs no read). `group`: the rows come
    in runs of `group` copies of one prompt, whose pass runs once (`prefill`, with `split_rows`).
    The one-turn case of `Turns`."""
    turns = Turns(model, input_ids, attention_mask, sampling, cut_graph, stop_when_done=stop_when_done, logps=logps,
                  group=group, split_rows=split_rows)
    turns.decode(sampling.max_new_tokens - 1)
    return (turns.tokens, turns.drawn) if logps else turns.tokens


def eager_generate(model, input_ids, attention_mask, sampling):
    """transformers' `generate` on a batch of left-padded prompts, with these settings only: the
    folder's generation_config.json (a repetition penalty, top-k, its temperature) is set aside,
    as the static loop reads none of it (generate fills every setting left unset from it, then
    from its own defaults, such as top-k 50: transformers 5.24's
    GenerationMixin._prepare_generation_config)."""
    from transformers import GenerationConfig

    saved, model.generation_config = model.generation_config, GenerationConfig()  # given back below: it is saved
    sample = {} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                         "top_k": sampling.top_k}
    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=not sampling.greedy,
                              eos_token_id=list(sampling.eos_ids), pad_token_id=sampling.pad_id, use_cache=True,
                              **sample)
    # Several processes keep stepping together until every one's rows have ended: FSDP's forward
    # gathers weights from all of them. generate turns synced_gpus on by itself only for modules
    # transformers sharded (transformers 5.24's distributed/fsdp.py, is_fsdp_managed_module), not for
    # torch's own fully_shard.
    synced = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    try:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                             synced_gpus=synced)
    finally:  # the model's own (a chat model's end-of-turn token) is written with it at the end of a run
        model.generation_config = saved
    tokens = out[:, input_ids.shape[1]:]
    # generate stops once every row has ended: fill up to max_new_tokens with padding
    return torch.nn.functional.pad(tokens, (0, sampling.max_new_tokens - tokens.shape[1]), value=sampling.pad_id)


def generate_rows(engine, model, loader, sampling):
    """Every row's generated tokens (a prepared loader of left-padded prompts with their `row`
    numbers), across replicas, in input order: one (rows, max_new_tokens) host tensor, copied
    once. Static shapes where the device compiles each new one, else transformers' `generate`."""
    plain = engine.unwrap_model(model)

    def forward(_, inputs):
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        if engine.accelerator.static_shapes:
            return static_generate(plain, ids, mask, sampling, engine.cut_graph)
        return eager_generate(plain, ids, mask, sampling)

    # token ids travel as floats with the row numbers (exact below 2**24, far above any vocabulary)
    table = predict_rows(engine, model, loader, lambda tokens: tuple(tokens.T.float()), "Generating", forward)
    return table.round().long()



def _logits_to_keep(model):
    """Only the last position's logits, where the model can leave out the others."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}


# ---------------------------------------------------------------------------------------------
# Several turns in one cache: a rollout whose rows take tool results between their turns


class Turns:
    """Generation that stops and resumes: a batch of left-padded prompts, then each row's
    completion of up to `sampling.max_new_tokens` tokens after its prompt, made in turns. Between
    turns the host appends tokens to chosen rows (a tool's result, rendered as the chat template's
    tool turn) and generation resumes in the same preallocated cache (`Slots`: the prompt's
    bucket plus the budget for full-attention layers, a ring of the window and a chunk less one
    for sliding ones), so a row keeps one shape whatever its turns. Without turns between
    (`decode` alone) it is `static_generate`.

    Every row has its own cursor (`cur`: the completion tokens it holds; the last of them is still
    to be fed), so rows that end, wait or resume at different places share the graphs: the prompt's
    pass (one per bucket), one decode step (one token for every row; a row that ended or waits
    writes nothing) and one pass over `chunk` appended tokens (appended tokens are left-padded to
    a multiple of `chunk` per turn, so every row's ends with the last chunk and its next token is
    picked there). A slot's mask is read from the position of the token it holds (`held`), so the
    window rule of sliding layers holds across turns.

    `state()` is what the host reads between turns (one transfer); `resume` takes it back with the
    appended tokens (one copy to the device). `group`, `split_rows`: as `prefill`'s. `logps`: each
    token the model draws keeps its log-probability (`drawn`, fp32 [rows, budget], under the
    logits divided by the temperature, 0 elsewhere: appended tokens, padding); it stays on the
    device across turns."""

    def __init__(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: Sampling,
                 cut_graph: Any, chunk: int = TURN_CHUNK, stop_when_done: bool = False, logps: bool = False,
                 group: int = 1, split_rows: Any = None) -> None:
        rows, length = input_ids.shape
        budget = sampling.max_new_tokens
        device = input_ids.device
        self.model, self.sampling, self.cut_graph, self.length, self.budget = model, sampling, cut_graph, length, budget
        self.stop_when_done = stop_when_done  # decode stops once every row has ended (a host read a step)
        config = model.config.get_text_config(decoder=True)
        check_layer_types(config)
        self.windows = layer_windows(config, length + budget)
        self.chunk = chunk
        self.sizes = {w: slots_of(w, length + budget, chunk) for w in self.windows.values()}
        self.plan: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
        self.cache = Cache(layers=[Slots(self.sizes[self.windows[t]], self.plan) for t in types])
        self.eager = eager_attention(config)
        self.extra = {**_logits_to_keep(model), "cache": self.cache, "use_cache": True}
        self.eos = torch.tensor(sampling.eos_ids, device=device)
        self.columns = torch.arange(budget, device=device)
        self.offsets = torch.arange(self.chunk, device=device)
        logits, positions = prefill(model, input_ids, attention_mask, self.cache, self.windows, self.eager, group,
                                    split_rows)
        self.start = attention_mask.long().sum(1)  # the position of each row's first completion token
        # the position of the token each slot holds (-1: none): the prompt's last tokens at slot t % size
        self.held = {}
        for w, size in self.sizes.items():
            kept = min(length, size)
            at = torch.arange(length - kept, length, device=device) % size
            real = torch.where(attention_mask[:, length - kept:].bool(), positions[:, length - kept:], -1)
            self.held[w] = torch.full((rows, size), -1, dtype=torch.long, device=device).index_copy(1, at, real)
        self.tokens = torch.full((rows, budget), sampling.pad_id, dtype=torch.long, device=device)
        self.made = torch.zeros(rows, budget, dtype=torch.bool, device=device)  # the model's tokens (not appended)
        self.drawn = torch.zeros(rows, budget, device=device) if logps else None
        self.cur = torch.zeros(rows, dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self._take(logits, ~self.done)
        self.cut_graph()

    def _by_type(self, masks: dict) -> Any:
        return masks_by_type(masks, self.windows, self.eager)

    def _take(self, logits: torch.Tensor, ready: torch.Tensor) -> None:
        """The next token of every `ready` row (not ended, with room) from its last logits, at its cursor."""
        token = pick(logits[:, -1], self.sampling)
        put = (self.columns == self.cur[:, None]) & ready[:, None]
        self.tokens = torch.where(put, token[:, None], self.tokens)
        if self.drawn is not None:
            self.drawn = torch.where(put, drawn_logp(logits[:, -1], token, self.sampling), self.drawn)
        self.made = self.made | put
        self.cur = self.cur + ready.long()
        self.done = self.done | (ready & ((token[:, None] == self.eos).any(-1) | (self.cur >= self.budget)))

    def _attend(self, index: torch.Tensor, write: torch.Tensor, query: torch.Tensor) -> Any:
        """Records the slots of the completion tokens at `index` ([rows, n]) that `write` says are
        fed now, and the mask of queries at positions `query` ([rows, n]) over every slot."""
        masks = {}
        for w, size in self.sizes.items():
            at = (self.length + index) % size
            self.held[w] = self.held[w].scatter(1, at, torch.where(write, self.start[:, None] + index,
                                                                   self.held[w].gather(1, at)))
            self.plan[size] = (at, write)
            held = self.held[w][:, None, None, :]
            seen = (held >= 0) & (held <= query[:, None, :, None])
            if w is not None:
                seen = seen & (query[:, None, :, None] - held < w)
            masks[w] = seen
        return self._by_type(masks)

    def decode(self, steps: int) -> None:
        """`steps` tokens more for every row still generating: each step feeds a row's last token
        (with `stop_when_done`, fewer once every row has ended or waits)."""
        for _ in range(steps):
            if self.stop_when_done and bool(self.done.all()):
                break
            ready = ~self.done
            index = (self.cur - 1).clamp(min=0)[:, None]
            query = self.start[:, None] + index
            mask = self._attend(index, ready[:, None], query)
            token = self.tokens.gather(1, index)
            logits = self.model(input_ids=token, attention_mask=mask, position_ids=query, **self.extra).logits
            self._take(logits, ready)
            self.cut_graph()  # every step is then the same graph

    def state(self) -> list[torch.Tensor]:
        """What the host reads between turns: tokens [rows, budget], which of them the model made,
        each row's cursor and whether it has ended (booleans as 0/1)."""
        return [self.tokens, self.made.long(), self.cur, self.done.long()]

    def resume(self, tokens: Any, made: Any, cur: Any, done: Any, feeds: list[list[int]], longest: int = 0) -> None:
        """Generation goes on after the host's turn: `tokens`, `made`, `cur`, `done` as the host
        left them (host tensors: the appended tokens written, their rows' cursors past them, every
        row that does not resume done) and each row's tokens to feed now (its last fed-to-be token,
        then the appended ones; none for a row that does not resume), in chunks; then each resumed
        row's next token. `longest`: feed as many chunks as a feed this long takes at least (the
        longest of every process's, where their forward passes call collectives)."""
        device = self.tokens.device
        longest = max(longest, *(len(f) for f in feeds))
        span = -(-longest // self.chunk) * self.chunk
        fed = torch.tensor([[self.sampling.pad_id] * (span - len(f)) + f for f in feeds], dtype=torch.long)
        lengths = torch.tensor([len(f) for f in feeds], dtype=torch.long)
        # split on the host: a slice of a device tensor at a moving offset would be a new graph per chunk
        parts = [torch.as_tensor(x).long() for x in (tokens, made, cur, done)] + [lengths, *fed.split(self.chunk, 1)]
        tokens, made, cur, done, lengths, *chunks = (x.to(device) for x in parts)
        self.tokens, self.made, self.cur, self.done = tokens, made.bool(), cur, done.bool()
        base = cur - span  # the completion index of each row's first fed slot (left padding before its feed)
        first = cur - lengths  # its first fed token's
        step = torch.zeros((), dtype=torch.long, device=device)
        for piece in chunks:
            index = base[:, None] + step + self.offsets
            write = index >= first[:, None]
            # padding queries stand where the row's cached tokens end (no row of a mask is empty)
            query = self.start[:, None] + torch.where(write, index, first[:, None] - 1)
            mask = self._attend(index, write, query)
            logits = self.model(input_ids=piece, attention_mask=mask, position_ids=query,
                                **self.extra).logits
            ends = index[:, -1] + 1 == cur  # the row's feed ends in this chunk: its next token is picked here
            self._take(logits, ends & ~self.done)
            step = step + self.chunk
            self.cut_graph()
