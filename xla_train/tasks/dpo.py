"""Preference tuning of a decoder LLM on chosen/rejected pairs: `--problem dpo` (DPO, IPO, RPO).

Rows come in TRL's explicit-prompt preference forms:

    strings          `prompt`, `chosen`, `rejected` texts; the loss covers each completion and its
                     end-of-sequence token
    conversational   `prompt` a list of turns [{role, content}, ...], `chosen` and `rejected` lists
                     holding the assistant's turn(s), rendered with the tokenizer's chat template;
                     the loss covers the completion turns (their end-of-turn markup included)

One pair is one row: prompt + chosen (segment 1), then prompt + rejected (segment 2), positions
from 0 in each, labels the completion's tokens only, shifted as a causal LM's are (causal_lm.join);
the causal-LM forward keeps the two sequences apart (kernels.attention.document_inputs), so a row
computes exactly what the two sequences compute one by one. Rows are padded to length buckets;
`--max-length` is a row's length, both sequences together: longer pairs keep their prompt and have
their completions cut.

The reference model costs no second copy: with --lora it is the same model with its adapters
disabled (peft's `disable_adapter`), run in the same step without gradients; without LoRA its
log-probabilities are computed once, before training, by the model as it starts (TRL's
`precompute_ref_log_probs`), and carried with every row (`ref_chosen`, `ref_rejected`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..core.errors import UserError
from .base import ModelPart, Objective, PassInputs, Rows, Task, row_name
from .causal_lm import (
    DecoderModel,
    HeadInput,
    PackCollator,
    check_own_rows,
    documents_memory_inputs,
    fine_tuned_decoder,
    join,
    own_splits,
    router_coef_of,
    router_metrics,
    router_weight,
    run_documents,
    with_router_loss,
)
from .completion import Completions, eval_samples
from .declare import option
from .documents import IGNORE, SOURCE_ROW, _turns, encode
from .kinds import register

COLUMNS = ("prompt", "chosen", "rejected")
REFERENCE = ("ref_chosen", "ref_rejected")  # the precomputed reference log-probabilities, per row
LOSSES = ("sigmoid", "ipo")
KEYS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
        "logps/rejected", "loss")  # TRL's names; the first is the main metric (maximised)


# ---------------------------------------------------------------------------------------------
# Rows


def form_of(ds, path):
    """"strings" or "conversational", told by the first row's prompt; one line if a column is missing."""
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise UserError(f"{path}: preference rows need 'prompt', 'chosen' and 'rejected' columns; missing "
                        f"{', '.join(repr(c) for c in missing)} (columns: {', '.join(ds.column_names)})")
    if not len(ds):
        raise UserError(f"{path}: no rows")
    return "conversational" if isinstance(ds[0]["prompt"], list) else "strings"


def encode_pair(row, form, tokenizer, where):
    """A pair's two sequences, each (token ids, per token whether the loss covers it), prompt first."""
    chosen, rejected = row["chosen"], row["rejected"]
    if form == "strings":
        for name in COLUMNS:
            if not isinstance(row[name], str):
                raise UserError(f"{where}: '{name}' must be text, found {type(row[name]).__name__} "
                                f"{str(row[name])[:40]!r} (the first row's prompt is text)")
        for name in ("chosen", "rejected"):
            if not row[name].strip():
                raise UserError(f"{where}: empty {name} completion")
        if chosen == rejected:
            raise UserError(f"{where}: chosen and rejected are the same completion")
        return tuple(encode({"prompt": row["prompt"], "completion": c}, "prompt/completion", tokenizer, where)
                     for c in (chosen, rejected))
    for name in COLUMNS:
        if not isinstance(row[name], list):
            raise UserError(f"{where}: '{name}' must be a list of turns, each {{\"role\": ..., \"content\": ...}} "
                            f"(the first row's prompt is one); found {str(row[name])[:80]!r}")
    if _plain(chosen) == _plain(rejected):
        raise UserError(f"{where}: chosen and rejected are the same completion")
    return tuple(_conversation(row["prompt"], c, name, tokenizer, where)
                 for name, c in (("chosen", chosen), ("rejected", rejected)))


def _plain(turns):
    return [(m.get("role"), m.get("content")) if isinstance(m, dict) else m for m in turns]


def _conversation(prompt, completion, name, tokenizer, where):
    """The prompt's turns and a completion's rendered with the chat template; the completion is
    the characters its turns add to the prompt's rendering with the generation prompt."""
    prompt = _turns(prompt, f"{where}: 'prompt'")
    if not completion:
        raise UserError(f"{where}: empty {name} completion (no turns)")
    turns = _turns(completion, f"{where}: '{name}'")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in turns):
        raise UserError(f"{where}: the {name} completion has no assistant turn with text (roles: "
                        f"{', '.join(m['role'] for m in turns)})")
    start = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    text = tokenizer.apply_chat_template(prompt + turns, tokenize=False)
    if not (text.startswith(start) and len(text) > len(start)):
        raise UserError(f"{where}: the chat template does not render the prompt's turns as the start of the "
                        f"{name} conversation, so its completion cannot be found in it")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [a >= len(start) for a, _ in enc["offset_mapping"]]


def cut(pair, max_length):
    """The pair's two sequences within `max_length` tokens together: each prompt kept whole, the
    completions cut (each keeps at least half of the room left, or all it has if the other needs
    less). Returns (the sequences, whether any was cut), or None where the prompts leave no room."""
    prompts = [trained.index(True) if True in trained else len(trained) for _, trained in pair]
    answers = [len(ids) - p for (ids, _), p in zip(pair, prompts)]
    if sum(answers) + sum(prompts) <= max_length:
        return pair, False
    room = max_length - sum(prompts)
    if room < 2:
        return None
    first = min(answers[0], max(room // 2, room - answers[1]))
    keep = (prompts[0] + first, prompts[1] + min(answers[1], room - first))
    return tuple((ids[:n], trained[:n]) for (ids, trained), n in zip(pair, keep)), True


def pairs(ds, form, tokenizer, max_length, path):
    """Every row as two documents (input_ids, labels) for causal_lm.join: labels shifted (a token's
    label is the next token where that one is trained, else IGNORE). Returns (documents, pairs cut,
    pairs left out for a prompt that leaves no room)."""
    if form == "conversational" and not tokenizer.chat_template:
        raise UserError(f"{path}: conversational pairs need a chat template, and the model's tokenizer has none; "
                        "give 'prompt', 'chosen' and 'rejected' as text, or use a model whose tokenizer has a "
                        "chat_template")
    docs, truncated, left_out = [], 0, 0
    rows = ds.to_list() if len(ds) < 2_000 else ds
    for i, row in enumerate(rows):
        where = f"{path}: {row_name(path, row.get(SOURCE_ROW, i))}"
        fitted = cut(encode_pair(row, form, tokenizer, where), max_length)
        if fitted is None:
            left_out += 1
            continue
        pair, was_cut = fitted
        truncated += was_cut
        for ids, trained in pair:
            docs.append((ids, [t if keep else IGNORE for t, keep in zip(ids[1:], trained[1:])] + [IGNORE]))
    return docs, truncated, left_out


class PairCollator(PackCollator):
    """PackCollator's columns, and each row's float columns (the reference log-probabilities, the
    row's number for the reference pass) where the rows have them."""

    FLOATS = (*REFERENCE, "row")

    def __call__(self, items):
        import torch

        batch = super().__call__(items)
        features = [f for f, _, _ in items]
        for name in self.FLOATS:
            if name in features[0]:
                batch[name] = torch.tensor([float(f[name]) for f in features], dtype=torch.float32)
        return batch


@dataclass(frozen=True)
class PairRows(Rows):
    """A pair per row (causal_lm.join of its two documents), padded to length buckets."""

    form: str | None = None
    files: dict[str, str] | None = None
    unit = "pairs"

    def tokenize(self, splits: Any, tokenizer: Any, max_length: int) -> tuple[Any, dict[str, int]]:
        import datasets

        if tokenizer.eos_token_id is None:
            raise UserError("--problem dpo needs a tokenizer with an end-of-sequence token (none is set)")
        files = self.files or {}
        data, truncated = {}, {}
        for split, ds in splits.items():
            where = files.get(split, split)
            docs, truncated[split], left_out = pairs(ds, self.form, tokenizer, max_length, where)
            if left_out:
                print(f"{where}: {left_out} pair(s) have prompts that leave no room for their completions within "
                      f"--max-length {max_length} (both sequences of a pair); left out")
            if not docs:
                raise UserError(f"{where}: no pair fits --max-length {max_length} (a row holds both sequences)")
            data[split] = datasets.Dataset.from_dict(join(docs, [[i, i + 1] for i in range(0, len(docs), 2)]))
        return datasets.DatasetDict(data), truncated

    def collator(self, tokenizer: Any) -> PairCollator:
        return PairCollator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


# ---------------------------------------------------------------------------------------------
# The objective


@dataclass
class PairOutput:
    """DPO's forward: the policy's head input, the rows' segments, and the reference: per-row
    log-probabilities (precomputed), or the head input of the model with its adapters disabled.
    `loss` keeps its per-row values here for `step_metrics`."""

    policy: Any  # HeadInput, or the model's output where its head is computed whole
    segments: Any
    reference: Any = None  # (ref_chosen, ref_rejected) per row
    reference_head: Any = None  # as `policy`, with --lora: the adapters disabled
    rows: dict[str, Any] | None = None


def peft_model_of(model):
    """The peft PeftModel inside the wrappers (torch.compile's `_orig_mod`, DDP's and FSDP's
    `module`), or None."""
    while model is not None:
        if hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):
            return model
        model = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
    return None


@dataclass(frozen=True)
class PreferenceObjective(Objective):
    """DPO's sigmoid loss (or IPO's, and RPO's NLL term) on each pair's summed completion
    log-probabilities against the reference's; TRL's rewards and log-probabilities as metrics."""

    attention: str = "auto"
    beta: float = 0.1
    loss_type: str = "sigmoid"
    rpo_alpha: float | None = None
    router_aux_loss_coef: float | None = None  # the routers' loss weight (None: the model config's)

    def memory_inputs(self, model: Any, device_kind: str, length: int) -> PassInputs:
        """The causal-LM forward's; with adapters, the reference pass in the step as well."""
        path = documents_memory_inputs(model, device_kind, length, self.attention)
        return dataclasses.replace(path, reference=path.logits if peft_model_of(model) is not None else None)

    def forward(self, model: Any, inputs: dict[str, Any]) -> PairOutput:
        """The policy on the pairs (causal_lm.run_documents: the final hidden states and the head,
        or the model's output where the chunks cannot compute its head); the reference's values:
        the rows' precomputed columns, or with adapters the same model with them disabled, without
        gradients (reference_logps reads it without gradients too). A mixture of experts in
        training: the policy's routers' loss over the pairs' real tokens (causal_lm.run_documents)."""
        import torch

        inputs = dict(inputs)
        reference = tuple(inputs.pop(c) for c in REFERENCE) if REFERENCE[0] in inputs else None
        inputs.pop("row", None)
        weight = router_weight(model, self.router_aux_loss_coef)
        out = PairOutput(run_documents(model, inputs, self.attention, router_weight=weight), inputs["segments"],
                         reference)
        if reference is None:
            peft = peft_model_of(model)
            if peft is not None:
                with torch.no_grad(), peft.disable_adapter():
                    out.reference_head = run_documents(model, inputs, self.attention)
        return out

    @staticmethod
    def logps(head, labels, segments):
        """Per row: the chosen and rejected completions' summed log-probabilities and their tokens."""
        import torch.nn.functional as F

        from ..kernels.lm_loss import chunked_token_losses

        if isinstance(head, HeadInput):
            token = -chunked_token_losses(head.hidden, head.weight, labels, head.bias, head.softcap,
                                          ignore_index=IGNORE)
        else:  # the model's own logits
            token = -F.cross_entropy(head.logits.float().transpose(1, 2), labels, ignore_index=IGNORE,
                                     reduction="none")
        trained = labels != IGNORE
        chosen, rejected = trained & (segments == 1), trained & (segments == 2)
        return ((token * chosen).sum(1), (token * rejected).sum(1), chosen.sum(1).float(), rejected.sum(1).float())

    def reference_logps(self, output, labels):
        import torch

        if output.reference is not None:
            return output.reference
        if output.reference_head is None:
            raise RuntimeError("no reference: without --lora the reference log-probabilities are precomputed "
                               "before training (before_training)")
        with torch.no_grad():
            chosen, rejected, _, _ = self.logps(output.reference_head, labels, output.segments)
        return chosen, rejected

    def per_row(self, output, labels):
        """Per row: the loss and TRL's metrics (rewards, accuracies, margins, log-probabilities)."""
        import torch.nn.functional as F

        chosen, rejected, n_chosen, n_rejected = self.logps(output.policy, labels, output.segments)
        ref_chosen, ref_rejected = self.reference_logps(output, labels)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        if self.loss_type == "ipo":  # TRL: the ratios' means per completion token
            delta = chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1)
            losses = (delta - 1 / (2 * self.beta)) ** 2
        else:
            losses = -F.logsigmoid(self.beta * (chosen_ratio - rejected_ratio))
        rewards_chosen, rewards_rejected = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        rows = {"rewards/accuracies": (rewards_chosen > rewards_rejected).float(),
                "rewards/margins": rewards_chosen - rewards_rejected,
                "rewards/chosen": rewards_chosen, "rewards/rejected": rewards_rejected,
                "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}  # KEYS' order
        return losses, chosen, n_chosen, rows

    def loss(self, output: PairOutput, labels: Any) -> Any:
        """The mean over the batch's pairs; with --rpo-alpha, plus alpha times the chosen
        completions' negative log-likelihood per token (TRL's "sft" term); plus the routers'
        weighted load-balancing loss where the forward computed it (TRL's DPOTrainer adds it so)."""
        losses, chosen, n_chosen, rows = self.per_row(output, labels)
        loss = losses.mean()
        if self.rpo_alpha:
            loss = loss + self.rpo_alpha * (-chosen.sum() / n_chosen.sum().clamp(min=1))
        output.rows = rows
        return with_router_loss(loss, output.policy)

    def step_metrics(self, output: Any, labels: Any) -> dict[str, Any] | None:
        """The batch's means of the per-row metrics `loss` kept on `output`; the routers' loss
        (`aux_loss`) where there is one."""
        return {**{k: v.float().mean() for k, v in output.rows.items()}, **router_metrics(output.policy)}

    def before_training(self, engine, model, data, make_loader, initial):
        """Without adapters: every row's reference log-probabilities, by the model as training
        begins, once (columns `ref_chosen`, `ref_rejected`); with them, `data` as it is."""

        if peft_model_of(model) is not None or REFERENCE[0] in data["train"].column_names:
            return data
        reference = initial()
        out = {}
        for split, ds in data.items():
            values = self.reference_values(engine, reference, make_loader(ds.add_column("row", list(range(len(ds)))),
                                                                          split), split)
            ds = ds.add_column(REFERENCE[0], values[:, 0].tolist())
            out[split] = ds.add_column(REFERENCE[1], values[:, 1].tolist())
        return type(data)(out)

    def reference_values(self, engine, model, loader, split="train"):
        """Every row's (chosen, rejected) log-probabilities by `model`, in input order, on every
        replica: a host tensor [rows, 2]."""
        import torch

        from ..core.inference import infer

        def columns(batch, output):
            chosen, rejected, _, _ = self.logps(output.policy, batch["labels"], output.segments)
            return batch["row"].float(), chosen.float(), rejected.float()

        table = torch.stack(infer(engine, model, loader, columns, f"Reference log-probabilities ({split})",
                                  forward=self.forward), 1)
        return table[table[:, 0].round().long().argsort(), 1:]

    def keys(self) -> list[str]:
        return list(KEYS)

    def load_metric(self) -> None:
        return None

    def eval_columns(self, batch: dict[str, Any], output: Any) -> tuple:
        losses, chosen, n_chosen, rows = self.per_row(output, batch["labels"])
        if self.rpo_alpha:
            losses = losses + self.rpo_alpha * (-chosen / n_chosen.clamp(min=1))
        return (*(rows[k].float() for k in KEYS[:-1]), losses.detach().float())

    def score(self, metric: Any, columns: tuple) -> dict[str, float]:
        n = len(columns[0])
        return {**{k: float(c.double().mean()) if n else math.nan for k, c in zip(KEYS, columns)}, "n": n}


# ---------------------------------------------------------------------------------------------
# The model and the kind


@dataclass(frozen=True)
class DPOOptions:
    """DPO's own options (TRL's DPOConfig names where it has them), a recipe's `dpo:` section."""

    beta: float = option(0.1, "dpo: how far the policy may move from the reference model (DPO's beta; IPO's tau); "
                         "the rewards are beta times the log-probability ratios")
    dpo_loss: str = option("sigmoid", "dpo: sigmoid (DPO's loss) or ipo (IPO's squared loss on the per-token mean "
                           "log-probability ratios, as TRL computes it)", LOSSES)
    rpo_alpha: float = option(None, "dpo: add this weight times the chosen completions' negative log-likelihood "
                              "(token mean) to the loss (RPO; default: none)")

    def check(self) -> None:
        from ..core.errors import check_number

        check_number("--beta", self.beta, lambda x: x > 0, "a positive number")
        check_number("--rpo-alpha", self.rpo_alpha, lambda x: x >= 0, "a number >= 0")


@register
@dataclass(frozen=True)
class DPO(Task):
    """Direct preference optimisation of a decoder on chosen/rejected pairs."""

    kind = "dpo"
    Options = DPOOptions
    form: str | None = None  # "strings" or "conversational"
    files: dict[str, str] | None = None
    attention: str = "auto"
    beta: float = 0.1
    dpo_loss: str = "sigmoid"
    rpo_alpha: float | None = None
    router_aux_loss_coef: float | None = None  # the routers' loss weight (None: the model config's)

    # --- options ----------------------------------------------------------------------------
    @classmethod
    def check_options(cls, opts):
        """Pairs are padded to buckets (no packing)."""
        if opts.packing is not None:
            raise UserError(f"--{'' if opts.packing else 'no-'}packing: --problem dpo puts each pair in a row of its "
                            "own, padded to --buckets")
        if opts.max_new_tokens and not opts.test_file:
            raise UserError("--max-new-tokens applies to --test-file's completions")

    @classmethod
    def load(cls, source):
        check_own_rows(source, "dpo", "own preference pairs",
                       "preference rows have 'prompt', 'chosen' and 'rejected' columns")
        # the kind's own options (the task's defaults where no options are given: load_task in a loop)
        own = source.options.kind_options() if source.options else DPOOptions()
        settings = dataclasses.asdict(own)
        return load_pairs(source.train_file, source.validation_file, source.seed, source.max_length, cls,
                          source.attention, {**settings, "router_aux_loss_coef": router_coef_of(source)})

    # --- the parts --------------------------------------------------------------------------
    @cached_property
    def rows(self):
        return PairRows(self.form, self.files)

    @cached_property
    def objective(self):
        return PreferenceObjective(None, self.eval_splits, self.attention, self.beta, self.dpo_loss, self.rpo_alpha,
                                   self.router_aux_loss_coef)

    @cached_property
    def model(self) -> ModelPart:
        return DecoderModel("dpo", self.router_aux_loss_coef)

    @cached_property
    def prediction(self):
        return Completions(self)

    # --- --eval-samples ---------------------------------------------------------------------
    def sample_rows(self, splits, n):
        """The first `n` validation pairs' prompts; the reference is the chosen completion (of a
        conversation, its first assistant turn: generation stops at that turn's end)."""
        split = splits[self.eval_splits[0]]
        samples = []
        for i, row in enumerate(split.select(range(min(n, len(split)))).to_list()):
            if self.form == "strings":
                samples.append(({"prompt": row["prompt"]}, "prompt", row["chosen"],
                                {"prompt": row["prompt"], "completion": row["chosen"]}))
                continue
            path = (self.files or {})[self.eval_splits[0]]
            where = f"{path}: {row_name(path, row.get(SOURCE_ROW, i))}"
            prompt, chosen = _turns(row["prompt"], f"{where}: 'prompt'"), _turns(row["chosen"], f"{where}: 'chosen'")
            first = next((k for k, m in enumerate(chosen) if m["role"] == "assistant"), None)
            if first is None:
                raise UserError(f"{where}: the chosen completion has no assistant turn (roles: "
                                f"{', '.join(m['role'] for m in chosen)})")
            samples.append(({"messages": prompt}, "messages", chosen[first]["content"],
                            {"messages": prompt + chosen[:first + 1]}))
        return samples

    def samples(self, rows, tokenizer, model, batch_size):
        form = "prompt/completion" if self.form == "strings" else "messages"
        return eval_samples(rows, form, tokenizer, model, self.max_length, batch_size)

    # --- what the output folder records -----------------------------------------------------
    @classmethod
    def claims(cls, config):
        return fine_tuned_decoder(config)

    @classmethod
    def from_config(cls, config, saved):
        return cls(saved.get("task") or "custom", None, main=KEYS[0], max_length=saved.get("max_length", 128),
                   form=saved.get("form"), beta=saved.get("beta", 0.1), dpo_loss=saved.get("dpo_loss", "sigmoid"),
                   rpo_alpha=saved.get("rpo_alpha"))

    def record(self):
        return {"task": self.name, "problem": self.problem, "labels": None, "form": self.form,
                "max_length": self.max_length, "beta": self.beta, "dpo_loss": self.dpo_loss,
                "rpo_alpha": self.rpo_alpha}

    def describe(self, splits):
        sizes = ", ".join(f"{len(ds)} {split}" for split, ds in splits.items())
        extra = f", rpo_alpha {self.rpo_alpha}" if self.rpo_alpha else ""
        return (f"task {self.name}: dpo ({self.dpo_loss} loss, beta {self.beta}{extra}) on {self.form} pairs; "
                f"{sizes} pairs")


def load_pairs(train_file, validation_file=None, seed=0, max_length=128, kind=None, attention="auto", settings=None):
    """A preference task (of `kind`, DPO or a kind built on it) and its splits from own rows
    (causal_lm.own_splits); `settings`: the kind's own options by name (beta, dpo_loss, rpo_alpha) and
    router_aux_loss_coef."""
    splits, files, form = own_splits(train_file, validation_file, seed, form_of, "pairs")
    kind = kind or DPO
    return (kind("custom", None, main=KEYS[0], max_length=max_length, form=form, files=files, attention=attention,
                 **(settings or {})), splits)
