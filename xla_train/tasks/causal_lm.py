"""Instruction fine-tuning of a decoder LLM: `--problem causal-lm`.

Rows come in one of three forms, told by their columns (TRL's SFTTrainer takes the same):

    messages             chat turns [{role, content}, ...] rendered with the tokenizer's chat
                         template; the loss covers the assistant turns. With a `tools` column
                         (tool-calling traces, TRL's SFT form), rendered with the tools; the
                         assistant's tool calls are trained, the tools' results are not
    prompt, completion   the loss covers the completion and its end-of-sequence token
    text                 the loss covers every token

Each row is one document. `--packing` (the default) puts whole documents into rows of exactly
`--max-length` tokens (best-fit decreasing); `--no-packing` gives each document a row of its own,
padded to length buckets. Either way a row carries each token's `position_ids` (from 0 in every
document) and `segments` (its document's number in the row, 0 for padding), and the forward pass
turns the segments into a 4-D mask: every document attends causally to itself only. So a packed
row computes exactly what its documents compute one by one, with one static shape per run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..core.errors import UserError
from .base import ModelPart, Objective, PassInputs, Rows, Task, row_name
from .completion import Completions, eval_samples
from .documents import (
    FORMS,
    IGNORE,
    SOURCE_ROW,
    TOOLS,
    _turns,
    chat,
    documents,
    encode,
    form_of,
    prompt_ids,
)
from .kinds import register
from .sequence import is_classifier_config

__all__ = ["FORMS", "IGNORE", "CausalLM", "PackCollator", "chat", "documents", "encode", "form_of", "join",
           "load_causal", "pack", "prompt_ids"]

COLUMNS = ("input_ids", "labels", "position_ids", "segments")  # a row's token columns (the collator pads them)
HELD_OUT = 0.05  # without --validation-file: the share of the training rows held out (transformers' run_clm)


def _causal_lm():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def is_decoder_config(config):
    """Whether a transformers config is a decoder that generates: a causal-LM architecture, or a
    model type with a causal-LM class and no masked-LM one (BERT has both: it is an encoder)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if getattr(config, "is_encoder_decoder", False):
        return False
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.architectures or ()):
        return True
    return (config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def fine_tuned_decoder(config):
    """Whether a saved folder's config is one a decoder kind fine-tuned (causal-lm, dpo, grpo): a
    decoder with its causal-LM head, not a decoder classifier."""
    return not is_classifier_config(config) and is_decoder_config(config)


@dataclass(frozen=True)
class DocumentRows(Rows):
    """Rows of whole documents, packed into rows of exactly the maximum length (best-fit
    decreasing) or one document each (then padded to buckets); `files`: each split's source, for
    messages."""

    form: str | None = None  # which of FORMS the rows have
    files: dict[str, str] | None = None
    packing: bool = True
    unit = "documents"

    @property
    def packed(self) -> bool:
        return self.packing

    def tokenize(self, splits: Any, tokenizer: Any, max_length: int) -> tuple[Any, dict[str, int]]:
        """Every split as rows of documents (packed or one each); returns (data, documents
        truncated per split)."""
        import datasets

        if tokenizer.eos_token_id is None:
            raise UserError("--problem causal-lm needs a tokenizer with an end-of-sequence token (none is set)")
        files = self.files or {}
        data: dict[str, Any] = {}
        truncated: dict[str, int] = {}
        counts: dict[str, int] = {}
        for split, ds in splits.items():
            where = files.get(split, split)
            docs, truncated[split], empty = documents(ds, self.form, tokenizer, max_length, where)
            if empty:
                print(f"{where}: {empty} document(s) have no trained token within --max-length {max_length}; left out")
            if not docs:
                raise UserError(f"{where}: no document has a trained token within --max-length {max_length}")
            rows = pack([len(ids) for ids, _ in docs], max_length) if self.packing else [[i] for i in range(len(docs))]
            data[split] = datasets.Dataset.from_dict(join(docs, rows))
            counts[split] = len(docs)
        if self.packing:
            packed = ", ".join(f"{counts[s]} {s} documents into {len(d)} rows" for s, d in data.items())
            print(f"packed {packed}"
                  + f" of {max_length} tokens (" + ", ".join(
                      f"{s} {sum(d['length']) / (len(d) * max_length):.1%} full" for s, d in data.items()) + ")")
        return datasets.DatasetDict(data), truncated

    def collator(self, tokenizer: Any) -> PackCollator:
        return PackCollator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    def padding(self, settle: Callable[[], Any], max_length: int, data: Any) -> Any:
        """Packed rows are exactly `max_length` tokens long: one shape."""
        from ..core.shapes import lengths, padding_for

        if not self.packing:
            return settle()
        return padding_for("max_length", None, max_length, [lengths(split) for split in data.values()])


@dataclass(frozen=True)
class HeadInput:
    """What NextToken's forward gives its loss: the final hidden states, before the LM head, and
    the head (weight, bias, soft-capping); the head and cross-entropy are computed in chunks of
    tokens (kernels.lm_loss), never as the whole [tokens x vocabulary] fp32 logits."""

    hidden: Any
    weight: Any
    bias: Any = None
    softcap: float | None = None
    router: Any = None  # RouterLoss: the routers' load-balancing loss, where the forward computed it
    context: Any = None  # kernels.context.Context: the rows' local tokens, whose sums the loss adds up


@dataclass(frozen=True)
class NextToken(Objective):
    """Next-token prediction: the mean cross-entropy over a batch's trained tokens; evaluation
    sums it token-weighted into the loss and perplexity. `attention`: how a packed row's documents
    are kept apart (kernels.attention.PATHS); `chunked_logits`: the head and cross-entropy computed
    in chunks of tokens (kernels.lm_loss.CHUNK_TOKENS), else as the model's own head computes them."""

    attention: str = "auto"
    chunked_logits: bool = True
    router_aux_loss_coef: float | None = None  # the routers' loss weight (None: the model config's)

    def memory_inputs(self, model: Any, device_kind: str, length: int) -> PassInputs:
        return documents_memory_inputs(model, device_kind, length, self.attention, self.chunked_logits)

    def forward(self, model: Any, inputs: dict[str, Any]) -> Any:
        return run_documents(model, inputs, self.attention, self.chunked_logits,
                             router_weight(model, self.router_aux_loss_coef), whole_rows=True)

    def token_losses(self, output: Any, labels: Any) -> tuple[Any, Any]:
        """Per row: the cross-entropy summed over its trained tokens, and their number (fp32)."""
        import torch.nn.functional as F

        from ..kernels.lm_loss import chunked_lm_loss

        if isinstance(output, HeadInput):
            sums = chunked_lm_loss(output.hidden, output.weight, labels, output.bias, output.softcap,
                                   ignore_index=IGNORE)
        else:
            losses = F.cross_entropy(output.logits.float().transpose(1, 2), labels, ignore_index=IGNORE,
                                     reduction="none")
            sums = losses.sum(1), (labels != IGNORE).sum(1).float()
        split = getattr(output, "context", None)  # local tokens (kernels.context): the whole rows' sums
        return split.row_sums(*sums) if split else sums

    def loss(self, output: Any, labels: Any) -> Any:
        """Mean cross-entropy over the batch's trained tokens (labels are already shifted); plus,
        where the forward computed it, the routers' weighted load-balancing loss (RouterLoss)."""
        total, tokens = self.token_losses(output, labels)
        return with_router_loss(total.sum() / tokens.sum().clamp(min=1), output)

    def step_metrics(self, output: Any, labels: Any) -> dict[str, Any] | None:
        return router_metrics(output) or None

    def keys(self) -> list[str]:
        return ["loss", "perplexity"]

    def load_metric(self) -> None:
        return None  # the loss is summed here, token-weighted

    def eval_columns(self, batch: dict[str, Any], output: Any) -> tuple:
        """Per row: the loss summed over its trained tokens, their number, and its documents."""
        total, tokens = self.token_losses(output, batch["labels"])
        documents, split = batch["segments"].amax(1).float(), getattr(output, "context", None)
        return total, tokens, split.row_max(documents) if split else documents

    def score(self, metric: Any, columns: tuple) -> dict[str, float]:
        loss_sum, tokens, docs = columns
        loss = float(loss_sum.double().sum() / tokens.double().sum())
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "n": int(docs.sum()),
                "n_tokens": int(tokens.sum())}


def run_documents(model: Any, inputs: dict[str, Any], attention: str = "auto", chunked: bool = True,
                  router_weight: float = 0.0, whole_rows: bool = False) -> Any:
    """The model on a batch whose `segments` keep its documents apart: causal within each
    document, nothing across documents (kernels.attention.document_inputs, by `attention`: a 4-D mask,
    or a kernel given the segments); padding (segment 0) attends to padding only. `chunked`, and
    where head_of can compute the model's head: the model stops before its head (its logits for
    one token only) and returns a HeadInput for the chunks; else the model's own output. A
    `router_weight` above 0 (a mixture of experts in training: `router_weight`): the routers'
    load-balancing loss over the batch's real tokens (segment above 0) rides on the output as its
    `router` (kernels.router_loss; the model's own is off: kernels.router_loss.models_own_off).
    `whole_rows`: the caller's loss sums each row over a context group where the model's rows are
    split (kernels.context: NextToken's does), which any other caller is refused."""
    from ..kernels import context
    from ..kernels.attention import document_inputs, unwrapped
    from ..kernels.lm_loss import head_of
    from ..kernels.router_loss import collected, load_balancing_loss

    segments = inputs["segments"]
    split = context.of(model)  # FSDP2 under a `context` axis: the rows' local tokens (kernels.context)
    if split and not whole_rows:
        raise UserError(f"`context_parallel` {split.size} on the cuda and cpu backends takes causal-lm runs only so "
                        "far (its loss sums each row over the context group; DPO's and GRPO's do not yet)")
    if split and router_weight:
        raise UserError(f"`context_parallel` {split.size} on the cuda and cpu backends does not take a mixture of "
                        "experts' routers' loss yet (it is not summed over the context group): set "
                        "`router_aux_loss_coef` 0, or use the xla backend")
    extra = split.inputs(model, segments) if split else document_inputs(model, segments, attention=attention)
    inputs = {k: v for k, v in inputs.items() if k != "segments"}
    hf = unwrapped(model)
    head = head_of(hf) if chunked else None
    with (collected(hf) if router_weight else contextlib.nullcontext()) as routers:
        if head is None:  # the whole head, as the model computes it
            output = model(**inputs, **extra)
        else:
            capture_outside_compilation(hf)
            output = model(**inputs, **extra, output_hidden_states=True, logits_to_keep=1)
            output = HeadInput(output.hidden_states[-1], *head)
    if router_weight:
        assert routers is not None  # collected(hf) ran
        # over the real tokens (segment above 0): the 2-D mask the family's loss takes
        router = RouterLoss(load_balancing_loss(hf, routers, segments > 0), router_weight)
        if isinstance(output, HeadInput):
            output = dataclasses.replace(output, router=router)
        else:  # the model's output (a ModelOutput) takes a new attribute as any object does
            output.router = router
    if split:
        if isinstance(output, HeadInput):
            output = dataclasses.replace(output, context=split)
        else:
            output.context = split
    return output


@dataclass(frozen=True)
class RouterLoss:
    """The routers' load-balancing loss of a forward (a 0-d fp32 device tensor) and its weight in
    the training loss (TRL's router_aux_loss_coef)."""

    value: Any
    weight: float


def router_weight(model: Any, asked: float | None) -> float:
    """The weight of the routers' load-balancing loss in a forward of `model` (kernels.router_loss.
    coefficient: TRL's rule, `asked` the --router-aux-loss-coef option), in training only: 0.0 in
    evaluation (model.eval()), where the loss is the language model's alone."""
    from ..kernels.attention import unwrapped
    from ..kernels.router_loss import coefficient

    return coefficient(unwrapped(model).config, asked) if model.training else 0.0


def with_router_loss(loss: Any, head: Any) -> Any:
    """`loss` plus the weighted routers' loss `head` carries (run_documents), as transformers adds
    it (`loss += router_aux_loss_coef * aux_loss`); `loss` where it carries none."""
    router = getattr(head, "router", None)
    return loss if router is None else loss + router.weight * router.value.to(loss.dtype)


def router_metrics(head: Any) -> dict[str, Any]:
    """{"aux_loss": the routers' load-balancing loss, unweighted (TRL's metric)} where `head`
    carries it, else {}."""
    router = getattr(head, "router", None)
    return {} if router is None else {"aux_loss": router.value.detach()}


def documents_memory_inputs(model: Any, device_kind: str, length: int, attention: str = "auto",
                            chunked: bool = True) -> PassInputs:
    """Objective.memory_inputs of `run_documents`'s path: the kernel that keeps documents apart
    (no dense mask) or the mask, and the head in chunks where head_of can compute it."""
    from ..kernels.attention import choose, fallback_note, unwrapped
    from ..kernels.lm_loss import head_of

    path = choose(attention, device_kind, model, length)
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    kernels = {"flex": "flex_attention", "pallas": "xla_flash"}  # memory.O_S_ATTENTION's names
    return PassInputs(kernels.get(path, implementation), path == "mask",
                      "chunked" if chunked and head_of(unwrapped(model)) else "whole",
                      note=fallback_note(attention, device_kind, model, length))


def capture_outside_compilation(model: Any) -> None:
    """Makes `output_hidden_states=True` work on `model` wherever it runs (transformers 5.24's
    utils/output_capturing.py):
    - each model class's `_can_record_outputs` is registered in `_CAN_RECORD_REGISTRY` by
      PreTrainedModel.__init__, which a model unpickled in a spawned worker (gloo, NCCL) never ran
      in that process: without it the model returns no hidden states. Registered here again;
    - the hooks that collect them are installed on the first call that asks for them
      (maybe_install_capturing_hooks); inside a torch.compile'd forward that splits the graph in
      two at every step. Installed here, before the model runs."""
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, maybe_install_capturing_hooks
    except ImportError:  # a transformers without the output-capturing hooks: nothing to do
        return
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's: the transformers model
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not _CAN_RECORD_REGISTRY.get(module):
            _CAN_RECORD_REGISTRY[module] = module._can_record_outputs
    maybe_install_capturing_hooks(model.base_model)


@dataclass(frozen=True)
class DecoderModel(ModelPart):
    """A pretrained decoder with its LM head (a sliding window shorter than the rows is applied per
    layer type: kernels.attention)."""

    peft_task_type = "CAUSAL_LM"
    problem: str = "causal-lm"  # the kind that trains it, for messages
    router_aux_loss_coef: float | None = None  # --router-aux-loss-coef (None: the model config's)

    def check(self, config: Any, name: str) -> None:
        from ..kernels.router_loss import has_routers
        from ..models import shown_name

        if not is_decoder_config(config):
            raise UserError(f"--model {shown_name(name)}: {config.model_type} is not a decoder with a causal LM head "
                            f"(architectures: {', '.join(config.architectures or ['none'])}); --problem "
                            f"{self.problem} trains decoders such as Llama, Qwen2, Gemma, Mistral or GPT-2")
        if self.router_aux_loss_coef and not has_routers(config):  # TRL refuses it too
            raise UserError(f"--router-aux-loss-coef {self.router_aux_loss_coef}: --model {shown_name(name)} "
                            f"({config.model_type}) is not a mixture of experts with router logits (Qwen3-MoE, "
                            "Mixtral, gpt-oss), so there is no routers' loss to weight")

    def load(self, name: str, seed: int, pad_token_id: int | None = None, **loading: Any) -> Any:
        """The pretrained decoder with its LM head, in fp32 whatever the checkpoint holds
        (--precision bf16 is autocast), without a key/value cache (training reads each row once)
        and without its own routers' loss (kernels.router_loss: the package computes it)."""
        import torch

        from ..kernels.router_loss import models_own_off
        from ..models import load_pretrained, no_cache, seed_host

        seed_host(seed)
        model = load_pretrained(_causal_lm(), name, dtype=torch.float32, **loading)
        return models_own_off(no_cache(model))

    def load_trained(self, folder: str, accelerator: str = "cpu") -> Any:
        from ..kernels.router_loss import models_own_off
        from ..models import load_trained

        return models_own_off(load_trained(_causal_lm(), folder, accelerator))


@register
@dataclass(frozen=True)
class CausalLM(Task):
    """Next-token prediction on documents; token-weighted loss and perplexity."""

    kind = "causal-lm"
    packing: bool = True
    form: str | None = None  # which of FORMS the rows have
    files: dict[str, str] | None = None  # split: where its rows came from (for messages)
    attention: str = "auto"  # how packed documents are kept apart (kernels.attention.PATHS)
    router_aux_loss_coef: float | None = None  # the routers' loss weight (None: the model config's)

    # --- options ----------------------------------------------------------------------------
    @classmethod
    def check_options(cls, opts):
        """Rows are told by their columns, packed unless --no-packing (then in length buckets);
        --max-new-tokens is --test-file's."""
        if opts.packing is not False and (opts.buckets != "auto" or opts.padding != "buckets"):
            raise UserError("--packing makes every row --max-length tokens long: --buckets and --padding apply to "
                            "--no-packing")
        if opts.max_new_tokens and not opts.test_file:
            raise UserError("--max-new-tokens applies to a causal LM's --test-file (--problem causal-lm)")

    @classmethod
    def load(cls, source):
        check_own_rows(source, "causal-lm", "own rows",
                       "causal-lm rows are told by their columns (messages, prompt/completion or text)")
        return load_causal(source.train_file, source.validation_file, source.seed, source.max_length,
                           source.packing is not False, cls, source.attention, router_coef_of(source))

    # --- the parts --------------------------------------------------------------------------
    @cached_property
    def rows(self):
        return DocumentRows(self.form, self.files, self.packing)

    @cached_property
    def objective(self):
        return NextToken(None, self.eval_splits, self.attention, router_aux_loss_coef=self.router_aux_loss_coef)

    @cached_property
    def model(self):
        return DecoderModel(router_aux_loss_coef=self.router_aux_loss_coef)

    @cached_property
    def prediction(self):
        return Completions(self)

    # --- --eval-samples ---------------------------------------------------------------------
    def sample_rows(self, splits, n):
        """The first `n` rows of the validation split: a prompt/completion row's prompt, or a
        conversation's turns before its last assistant turn (which is the reference), with its
        tools where it has them."""
        if self.form == "text":
            raise UserError("--eval-samples needs prompt/completion or messages rows: text rows have no prompt to "
                            "generate from")
        split = splits[self.eval_splits[0]]
        samples = []
        for i, row in enumerate(split.select(range(min(n, len(split)))).to_list()):
            source = row.pop(SOURCE_ROW, i)  # its row in the file, where the split was held out
            if self.form == "prompt/completion":
                samples.append(({"prompt": row["prompt"]}, "prompt", row["completion"], row))
                continue
            path = (self.files or {})[self.eval_splits[0]]
            where = f"{path}: {row_name(path, source)}"
            turns = _turns(row["messages"], where)
            last = max((j for j, m in enumerate(turns) if m["role"] == "assistant"), default=0)
            if not last:  # none, or only a first turn: nothing to prompt with
                raise UserError(f"{where}: --eval-samples needs turns before the last assistant turn")
            tools = {TOOLS: row[TOOLS]} if row.get(TOOLS) else {}
            samples.append(({"messages": turns[:last], **tools}, "messages", turns[last]["content"],
                            {"messages": turns[:last + 1], **tools}))
        return samples

    def samples(self, rows, tokenizer, model, batch_size):
        return eval_samples(rows, self.form, tokenizer, model, self.max_length, batch_size)

    # --- what the output folder records -----------------------------------------------------
    @classmethod
    def claims(cls, config):
        return fine_tuned_decoder(config)

    @classmethod
    def from_config(cls, config, saved):
        return cls(saved.get("task") or "custom", None, main="loss", max_length=saved.get("max_length", 128),
                   packing=saved.get("packing", True), form=saved.get("form"))

    def record(self):
        return {"task": self.name, "problem": self.problem, "labels": None, "form": self.form, "packing": self.packing,
                "max_length": self.max_length}

    def describe(self, splits):
        sizes = ", ".join(f"{len(ds)} {split}" for split, ds in splits.items())
        return f"task {self.name}: causal-lm on {self.form} rows; {sizes} documents"


# ---------------------------------------------------------------------------------------------
# Documents to rows


def pack(lengths, capacity):
    """Whole documents into rows of at most `capacity` tokens, best-fit decreasing: each document,
    longest first, goes to the row with the least room that still holds it. Returns the rows'
    document indices."""
    rows: list[list[int]]
    room: list[tuple[int, int]]
    rows, room = [], []  # room: sorted (free tokens, row index)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect_left(room, (lengths[i], -1))
        if at < len(room):
            free, r = room.pop(at)
        else:
            free, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        insort(room, (free - lengths[i], r))
    return rows


def join(docs, rows):
    """The columns of rows made of documents: tokens, labels, positions from 0 in each document,
    segments numbered from 1, the real length and the trained tokens."""
    out: dict[str, list] = {c: [] for c in (*COLUMNS, "length", "trained")}
    for row in rows:
        positions: list[int]
        ids, labels, positions, segments = [], [], [], []
        for n, d in enumerate(row, 1):
            doc_ids, doc_labels = docs[d]
            ids += doc_ids
            labels += doc_labels
            positions += range(len(doc_ids))
            segments += [n] * len(doc_ids)
        for column, values in zip(COLUMNS, (ids, labels, positions, segments)):
            out[column].append(values)
        out["length"].append(len(ids))
        out["trained"].append(sum(label != IGNORE for label in labels))
    return out


class PackCollator:
    """Pads a planned batch of causal-LM rows to its planned length: token ids with the pad token,
    labels with IGNORE, positions and segments with 0."""

    def __init__(self, pad_id):
        self.fill = {"input_ids": pad_id, "labels": IGNORE, "position_ids": 0, "segments": 0}

    def __call__(self, items):
        import torch

        features, pads, valid = zip(*items)
        batch = {c: torch.tensor([f[c] + [fill] * (pads[0] - len(f[c])) for f in features])
                 for c, fill in self.fill.items()}
        batch["valid"] = torch.tensor(valid, dtype=torch.long)
        return batch


# ---------------------------------------------------------------------------------------------
# The data source


def check_own_rows(source: Any, problem: str, rows: str, columns: str) -> None:
    """Stops with one line where a decoder kind's `source` asks for a GLUE task or text columns, or
    has no training rows: `rows` what the kind trains on, `columns` how its rows are told."""
    if source.task or source.data_dir:
        raise UserError(f"--problem {problem} trains on {rows} (--train-file), not on a GLUE task: leave out "
                        "--task and --data-dir")
    if source.text_columns:
        raise UserError(f"--text-columns applies to classification and regression; {columns}")
    if not source.train_file:
        raise UserError(f"--problem {problem} needs --train-file (and optionally --validation-file)")


def load_causal(train_file, validation_file=None, seed=0, max_length=128, packing=True, kind=None, attention="auto",
                router_aux_loss_coef=None):
    """A causal-LM task (of `kind`, CausalLM or a kind built on it) and its splits from own rows
    (`own_splits`)."""
    splits, files, form = own_splits(train_file, validation_file, seed, form_of)
    kind = kind or CausalLM
    return (kind("custom", None, main="loss", max_length=max_length, packing=packing, form=form, files=files,
                 attention=attention, router_aux_loss_coef=router_aux_loss_coef), splits)


def router_coef_of(source: Any) -> float | None:
    """A decoder kind's --router-aux-loss-coef from its source's options (None: not given)."""
    return getattr(source.options, "router_aux_loss_coef", None)


def own_splits(train_file, validation_file, seed, form_of, unit="rows"):
    """A decoder kind's own rows: files (.jsonl, .json, .csv, .parquet), `save_to_disk` folders, or
    hub data sets by name, both in one form (`form_of(ds, path)`). Without a validation source,
    HELD_OUT of the training rows (at least one) are held out. Returns (splits, each split's
    source, the form)."""
    import datasets

    from .files import read_source

    train = read_source(train_file, "train")
    files = {"train": train_file, "validation": validation_file}
    form = form_of(train, train_file)
    if validation_file:
        validation = read_source(validation_file, "validation")
    else:
        if len(train) < 2:
            raise UserError(f"{train_file}: one row; give --validation-file, or more rows to hold some out")
        train = train.add_column(SOURCE_ROW, list(range(len(train))))
        parts = train.train_test_split(test_size=max(1, round(HELD_OUT * len(train))), seed=seed)
        train, validation = parts["train"], parts["test"]
        files["validation"] = train_file
        print(f"no --validation-file: {len(validation)} of {train_file}'s rows held out for evaluation")
    if form_of(validation, files["validation"]) != form:
        raise UserError(f"{files['validation']} has {form_of(validation, files['validation'])} {unit} and "
                        f"{train_file} {form} {unit}; give both in one form")
    return datasets.DatasetDict({"train": train, "validation": validation}), files, form
