"""Reinforcement learning from rewards: `--problem grpo` (TRL 1.16's loss types: GRPO, Dr. GRPO, DAPO,
BNPO, CISPO, SAPO, LUSPO, VESPO; GSPO's sequence-level ratio), the policy
generating its own completions inside the training step, on the same devices (no second copy of
the weights, no weight transfer; a reference, where asked for, is the model with its adapters
disabled, or a frozen copy).

Rows are TRL's prompt-only forms: `prompt` as text, or as chat turns (rendered with the chat
template and its generation prompt). Every other column of a row is handed to the reward
functions (tasks/rewards.py), as TRL does.

One step, read top to bottom in `Rollouts.rollout` and `GroupObjective.loss`:

    prompts     a batch of --batch-size / --num-generations prompts, left-padded to a length bucket
    rollout     each prompt repeated --num-generations times; completions of --max-completion-length
                tokens sampled with static shapes (kernels/generate.py: a fixed-size cache, a prefill and
                a decode graph per bucket, stops by masks), in the update's precision, each token's
                log-probability kept as drawn (a group's prompt passes once, on eager devices and
                on XLA where the mesh splits rows only: Rollouts.shared, Rollouts.generating);
                the tokens cross to the host once
    scoring     the reward functions on the decoded completions; their weighted sum per completion
    advantages  each reward less its group's mean, divided by the group's standard deviation
                (TRL's scale_rewards "group"; "batch": the batch's; "none": not divided)
    fixed       without gradients: the reference's log-probabilities (beta > 0), and the policy's
                as sampled where the rollout is trained on --num-iterations times
    update      the policy's log-probabilities of the completion tokens (one forward with gradients,
                the head in chunks), the --loss-type's per-token term (TRL's clipped surrogate, or
                cispo's, sapo's, vespo's) with the ratio per token or per sequence, the top-entropy
                mask, with beta > 0 the KL estimate to the reference; normalised as --loss-type says;
                the sampler's log-probabilities compared with these (sampling/* metrics)

With --num-iterations K, each rollout is trained on K optimizer steps in a row: the whole rule
reads in `Iterations`.

A micro-batch holds every completion of its prompts, so a group's advantages need no collective:
--batch-size (completions per device, TRL's per_device_train_batch_size) must be a multiple of
--num-generations. TRL only asks the whole generation batch to divide and gathers rewards across
processes; this package is stricter so that no group straddles replicas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..core.errors import UserError, check_number
from .base import ModelPart, Objective, PassInputs, Rows, Task, row_name
from .causal_lm import (
    DecoderModel,
    HeadInput,
    check_own_rows,
    documents_memory_inputs,
    fine_tuned_decoder,
    own_splits,
    router_coef_of,
    router_metrics,
    router_weight,
    run_documents,
    with_router_loss,
)
from .completion import Completions, Samples, end_ids, left_padded, samples_of
from .declare import option
from .documents import IGNORE, SOURCE_ROW, _turns, prompt_ids
from .dpo import peft_model_of
from .kinds import register
from .rewards import Reward, TrainerState, completions_of, rewards_of, score, total
from .tools import (
    ENVIRONMENT_REWARD,
    TOOL_METRICS,
    Environments,
    Toolbox,
    ToolLoop,
    observed,
    specs_of,
)

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
LEVELS = ("token", "sequence")  # --importance-sampling-level
STEP_TOKENS = ("dapo", "cispo", "vespo")  # the loss types normalised by the step's completion tokens (TRL's)
SCALE_REWARDS = ("group", "batch", "none")
EXTRA = "columns"  # a row's prompt and other columns (JSON), for the reward functions
# the step's metrics under TRL's names, computed on the host with the rewards (one transfer with the advantages)
ROLLOUT_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio")


@dataclass(frozen=True)
class GRPOOptions:
    """GRPO's own options, TRL's GRPOConfig names and defaults; a recipe's `grpo:` section."""

    reward: str = option(None, "grpo: a reward function, module:function or path/file.py:function, called as TRL "
                         "calls one (xla_train.rewards has exact_match, number_match, think_format); repeat the flag "
                         "for several", repeat=True)
    reward_weights: str = option(None, "grpo: each --reward's weight in the reward, comma-separated (default: 1 each)")
    num_generations: int = option(8, "grpo: completions sampled per prompt (a group)")
    max_completion_length: int = option(256, "grpo: tokens a completion may take")
    temperature: float = option(1.0, "grpo: the sampling temperature of the rollouts (evaluation is greedy)")
    top_p: float = option(1.0, "grpo: sample from the likeliest tokens whose probability reaches this share")
    top_k: int = option(0, "grpo: sample from the k likeliest tokens only (0: all)")
    beta: float = option(0.0, "grpo: the weight of the KL estimate to the reference model (0: no reference, TRL's "
                         "default): with --lora the model with its adapters disabled, else a frozen copy")
    epsilon: float = option(0.2, "grpo: the clipping range of the importance ratio, below 1 and (without "
                            "--epsilon-high) above")
    epsilon_high: float = option(None, "grpo: the upper clipping range (DAPO's clip-higher; default: --epsilon); "
                                 "with --loss-type cispo the cap of the importance ratio itself (ScaleRL: 5.0)")
    loss_type: str = option("dapo", "grpo: grpo (each completion's token mean, averaged), dr_grpo (token sum over "
                            "completions x --max-completion-length), dapo (token mean over the step's completions "
                            "on every replica), bnpo (token mean over the micro-batch), cispo (MiniMax-M1: the ratio "
                            "capped at --epsilon-high, detached, times the advantage and the log-probability; dapo's "
                            "normalisation), sapo (a soft gate instead of the clip, --sapo-temperature-*; grpo's), "
                            "luspo (each completion's token sum, averaged; with --importance-sampling-level "
                            "sequence) or vespo (a gamma weight of the sequence's ratio, --vespo-*; dapo's)",
                            LOSS_TYPES)
    importance_sampling_level: str = option("token", "grpo: the importance ratio per token, or per sequence (GSPO: "
                                            "the exponential of the completion's mean log-ratio)", LEVELS)
    sapo_temperature_neg: float = option(1.05, "grpo: --loss-type sapo's gate temperature where the advantage is "
                                         "not positive")
    sapo_temperature_pos: float = option(1.0, "grpo: --loss-type sapo's gate temperature where the advantage is "
                                         "positive")
    vespo_k_pos: float = option(2.0, "grpo: --loss-type vespo's power k for advantages >= 0 (down-weights ratios "
                                "below 1)")
    vespo_lambda_pos: float = option(3.0, "grpo: --loss-type vespo's decay lambda for advantages >= 0 (down-weights "
                                     "ratios above 1)")
    vespo_k_neg: float = option(3.0, "grpo: --loss-type vespo's power k for negative advantages")
    vespo_lambda_neg: float = option(2.0, "grpo: --loss-type vespo's decay lambda for negative advantages")
    top_entropy_quantile: float = option(1.0, "grpo: keep in the policy loss only the completion tokens whose "
                                         "entropy is in this top share of the micro-batch's (Beyond the 80/20 "
                                         "rule: 0.2; 1: every token, 0: the highest only)")
    scale_rewards: str = option("group", "grpo: divide the advantages by the group's reward standard deviation "
                                "(group), the batch's (batch) or not at all (none)", SCALE_REWARDS)
    num_iterations: int = option(1, "grpo: updates on each rollout (TRL's num_iterations): above 1, a step's "
                                 "rollouts are trained on that many steps in a row, the ratio taken to the "
                                 "log-probabilities they were sampled with")
    mask_truncated_completions: bool = option(False, "grpo: leave completions that reach --max-completion-length "
                                              "without ending out of the loss")
    tools: str = option(None, "grpo: a tool the model may call during its rollouts, module:function or "
                        "path/file.py:function, with type hints and a Google-style docstring (TRL's tools; "
                        "tasks/tools.py); repeat the flag for several; --max-completion-length then counts every "
                        "token after the prompt, tool results included, as TRL's", repeat=True)
    environment: str = option(None, "grpo: TRL's environment_factory, module:Class or path/file.py:Class: one "
                              "instance per completion, reset with its row's columns before each rollout, its public "
                              "methods tools beside --tools', its get_reward() (if any) one more reward "
                              "(tasks/tools.py); several as NAME=module:Class, repeated, each row naming its own in "
                              "an 'environment' column (TRL's dict)", repeat=True)
    max_tool_calling_iterations: int = option(None, "grpo: tool turns a completion may take (TRL's; default: until "
                                              "it calls none, within --max-completion-length)")

    def check(self) -> None:
        if self.num_generations < 2:
            raise UserError(f"--num-generations must be at least 2 (a group's advantages compare its completions), "
                            f"not {self.num_generations}")
        if self.num_iterations < 1:
            raise UserError(f"--num-iterations must be at least 1, not {self.num_iterations}")
        if self.max_completion_length < 1:
            raise UserError(f"--max-completion-length must be at least 1, not {self.max_completion_length}")
        check_number("--temperature", self.temperature, lambda x: x > 0, "above 0 (rollouts are sampled)")
        check_number("--top-p", self.top_p, lambda x: 0 < x <= 1, "in (0, 1]")
        check_number("--top-k", self.top_k, lambda x: x >= 0, "an integer >= 0")
        check_number("--beta", self.beta, lambda x: x >= 0, "a number >= 0")
        check_number("--epsilon", self.epsilon, lambda x: 0 < x < 1, "in (0, 1)")
        check_number("--epsilon-high", self.epsilon_high, lambda x: x > 0, "a positive number")
        for name in ("sapo_temperature_neg", "sapo_temperature_pos"):  # the gate divides by them
            check_number(f"--{name.replace('_', '-')}", getattr(self, name), lambda x: x > 0, "a positive number")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_number(f"--{name.replace('_', '-')}", getattr(self, name), lambda x: x >= 0, "a number >= 0")
        check_number("--top-entropy-quantile", self.top_entropy_quantile, lambda x: 0 <= x <= 1, "in [0, 1]")
        check_number("--max-tool-calling-iterations", self.max_tool_calling_iterations, lambda x: x >= 0,
                     "an integer >= 0")
        toolbox = self.toolbox
        if self.max_tool_calling_iterations is not None and toolbox is None:
            raise UserError("--max-tool-calling-iterations applies to rollouts with --tools or --environment")
        if toolbox is not None:
            assert toolbox.schemas  # each tool found and described now (one line where one cannot be)
        self.rewards(toolbox)  # each function found now, before any data is read

    @property
    def toolbox(self) -> Toolbox | None:
        """The --tools functions and --environment's methods (None: neither)."""
        specs = specs_of(self.tools)
        return Toolbox(specs, self.environment) if specs or self.environment else None

    def rewards(self, toolbox: Toolbox | None = None) -> tuple[Reward, ...]:
        """The --reward functions, then the environment's get_reward (TRL's: weight 1, named after
        its class), with which --reward may be left out (`toolbox`: this options', made already)."""
        toolbox = toolbox or self.toolbox
        owned = toolbox.rewarded if toolbox is not None else {}
        rewards = rewards_of(self.reward, self.reward_weights, required=not owned)
        return rewards + tuple(Reward(shown, ENVIRONMENT_REWARD, label=f"--environment {spec}: {shown}.get_reward",
                                      owner=owner) for owner, (shown, spec) in owned.items())

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def odd_pairings(self) -> list[str]:
        """TRL 1.16's warnings for pairings it runs but advises against (GRPOTrainer.__init__), one
        line each."""
        level, loss = self.importance_sampling_level, self.loss_type
        lines = []
        if loss == "luspo" and level != "sequence":
            lines.append("--loss-type luspo: the LUSPO paper takes --importance-sampling-level sequence")
        if loss == "vespo" and level != "token":
            lines.append("--loss-type vespo computes the sequence's importance weight itself: keep "
                         "--importance-sampling-level token (the default)")
        if level == "sequence" and loss in ("bnpo", "dr_grpo", "dapo", "cispo"):
            lines.append(f"--importance-sampling-level sequence with --loss-type {loss} sums per-token terms, which "
                         "weights each completion by its length; GSPO's objective is --loss-type grpo")
        return lines


# ---------------------------------------------------------------------------------------------
# Rows: prompts


def form_of(ds, path):
    """"strings" or "conversational", told by the first row's prompt; one line without a prompt."""
    if "prompt" not in ds.column_names:
        raise UserError(f"{path}: GRPO's rows need a 'prompt' column (text or chat turns); the other columns go to "
                        f"the reward functions (columns: {', '.join(ds.column_names)})")
    if not len(ds):
        raise UserError(f"{path}: no rows")
    return "conversational" if isinstance(ds[0]["prompt"], list) else "strings"


class PromptCollator:
    """Left-pads a planned batch of prompts to its planned length (generation starts where every
    prompt ends): token ids with the pad token, the attention mask with 0; each row's number."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list) -> dict[str, Any]:
        import torch

        features, pads, valid = zip(*items)
        ids = [[self.pad_id] * (pads[0] - len(f["input_ids"])) + f["input_ids"] for f in features]
        mask = [[0] * (pads[0] - len(f["input_ids"])) + [1] * len(f["input_ids"]) for f in features]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
                "row": torch.tensor([f["row"] for f in features]), "valid": torch.tensor(valid, dtype=torch.long)}


@dataclass(frozen=True)
class PromptRows(Rows):
    """A prompt per row, its last --max-length tokens (TRL's max_prompt_length), padded on the left
    to length buckets; the row's columns kept beside it for the reward functions."""

    form: str | None = None
    files: dict[str, str] | None = None
    completions: int = 8  # --num-generations: the completions a prompt makes in a batch
    tools: tuple[str, ...] = ()  # --tools: the chat template renders the prompts with them
    environment: str | None = None  # --environment: its methods too
    unit = "prompts (each keeps its last tokens)"

    def batch_rows(self, batch_size: int) -> int:
        """A micro-batch of --batch-size completions holds batch_size / num_generations prompts."""
        return batch_size // self.completions

    def tokenize(self, splits: Any, tokenizer: Any, max_length: int) -> tuple[Any, dict[str, int]]:
        import datasets

        if self.form == "conversational" and not tokenizer.chat_template:
            raise UserError(f"{(self.files or {}).get('train', 'train')}: the prompts are chat turns, which need a "
                            "chat template, and the model's tokenizer has none; give the prompts as text")
        toolbox = None
        if self.tools or self.environment:
            if self.form != "conversational":
                flag = "--tools" if self.tools else "--environment"
                raise UserError(f"{(self.files or {}).get('train', 'train')}: {flag} needs chat prompts (TRL parses "
                                "tool calls from conversational completions only); the prompts are text")
            toolbox = Toolbox(self.tools, self.environment)
            toolbox.check(tokenizer)
        data, truncated = {}, {}
        for split, ds in splits.items():
            path = (self.files or {}).get(split, split)
            ids, extra = [], []
            for i, row in enumerate(ds.to_list()):
                where = f"{path}: {row_name(path, row.pop(SOURCE_ROW, i))}"
                form = "prompt" if self.form == "strings" else "messages"
                if self.form == "strings" and not isinstance(row["prompt"], str):
                    raise UserError(f"{where}: 'prompt' must be text, as the first row's is; found "
                                    f"{str(row['prompt'])[:60]!r}")
                if toolbox is not None:  # TRL renders the prompts with the tools (GRPOTrainer._tokenize_prompts)
                    ids.append(with_tools(tokenizer, _turns(row["prompt"], where), toolbox.schemas_of(row, where)))
                else:
                    ids.append(prompt_ids({form: row["prompt"]}, form, tokenizer, where))
                extra.append(json.dumps({**row, "_where": where}, default=str))
            truncated[split] = sum(len(x) > max_length for x in ids)
            ids = [x[-max_length:] for x in ids]
            data[split] = datasets.Dataset.from_dict({"input_ids": ids, "length": [len(x) for x in ids],
                                                      "row": list(range(len(ids))), EXTRA: extra})
        return datasets.DatasetDict(data), truncated

    def collator(self, tokenizer: Any) -> PromptCollator:
        return PromptCollator(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def with_tools(tokenizer: Any, messages: list[dict], schemas: list[dict]) -> list[int]:
    """A chat prompt's tokens, rendered with the tools' schemas and the assistant's turn opened."""
    text = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def observed_prompts(tokenizer: Any, found: list[dict], observations: list, schemas: list,
                     limit: int) -> tuple[list[list[int]], bool]:
    """Rows' chat prompts rendered again with their tools (`schemas`, each row's) and what their
    environments' resets returned (`observations`), each kept to its last `limit` tokens; and
    whether one was cut. `found`: the rows' columns with `_where`."""
    prompts = [with_tools(tokenizer, observed(_turns(f["prompt"], f["_where"]), o), own)
               for f, o, own in zip(found, observations, schemas)]
    return [p[-limit:] for p in prompts], any(len(p) > limit for p in prompts)


def agreement(engine: Any) -> Callable[[int], int] | None:
    """Where processes hold their own rows and their forward passes meet in collectives (FSDP2,
    tensor, context or expert axes over several processes), the largest of a count over them: a
    tool loop's turns, chunks and decode steps, which all of them must run alike. None elsewhere
    (SPMD's hosts read every row alike: its world size is 1)."""
    strategy = engine.strategy
    if not (strategy.world_size > 1 and (strategy.sharded or bool(strategy.axes.split))):
        return None

    def largest(n: int) -> int:
        import torch

        return int(strategy.gather(torch.tensor([n], device=engine.device)).max())

    return largest


def left_pad(prompts: list[list[int]], width: int, pad: int) -> tuple[Any, Any]:
    """Token ids left-padded to `width`, and their mask (1: a real token)."""
    import torch

    return (torch.tensor([[pad] * (width - len(p)) + p for p in prompts]),
            torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]))


# ---------------------------------------------------------------------------------------------
# Rollouts: prompts to completions, rewards and advantages, inside the step


@dataclass
class Rollout:
    """What a rollout hands the loss besides the model's inputs (the batch's `labels`)."""

    labels: Any  # [rows, length]: each completion token's id where the loss covers it (shifted), else IGNORE
    advantages: Any  # [rows]
    normalizer: Any  # 0-d: what STEP_TOKENS divide the token sum by (the step's completion tokens per replica)
    metrics: Any  # [len(ROLLOUT_KEYS) + 2 x functions]: the rollout's metrics, host-computed, on the device
    rewards: Any  # [rows]: each completion's reward
    per_function: Any  # [rows, functions]: each function's reward (NaN: none)
    old: Any = None  # [rows, length]: the labels' log-probabilities when sampled (--num-iterations > 1; None: now's)
    reference: Any = None  # [rows, length]: the reference model's (beta > 0)
    sampled: Any = None  # [rows, length]: the labels' log-probabilities as the decode graph drew them (training)


class Iterations:
    """GRPO's loop with --num-iterations K (TRL's num_iterations), the whole of it here, read top to
    bottom as torchtune's recipe writes it (generate_trajectory, then ppo_epochs x grpo_step) and
    TRL keeps it in one class (GRPOTrainer._prepare_inputs and its buffered inputs):

        for each optimizer step's micro-batches of prompts:
            rollout -> score -> advantages -> fixed log-probabilities  (Rollouts.rollout, at `take`)
            K updates on those rollouts                                (`take`: kept, handed back)
            a checkpoint only after the K-th: none holds a rollout     (`between_rollouts`, `check`)

    The trainer's loop runs one loaded micro-batch at a time, so K updates are K passes over the
    step's micro-batches: K is Shapes.repeats (GroupObjective.updates_per_batch), by which the batch
    plan hands each step's micro-batches K times in a row and an epoch counts K times the steps;
    Trainer.check_stop stops a signalled run at a step between them (step % Shapes.repeats == 0,
    `between_rollouts`). One per worker (Rollouts.iterations)."""

    def __init__(self, k: int = 1) -> None:
        self.k = k
        self.kept: list[dict[str, Any]] = []  # the step's rollouts, one per micro-batch, for the later updates
        self.at: int | None = None  # the step whose micro-batches `slot` counts
        self.slot = 0

    def between_rollouts(self, step: int) -> bool:
        """After `step` optimizer steps, a rollout's K updates have all run: the next step rolls
        out anew, and a checkpoint may fall here (it keeps no rollout)."""
        return step % self.k == 0

    def check(self, save_every: int | None) -> None:
        """--save-every falls between rollouts: a multiple of K."""
        if save_every and save_every % self.k:
            raise UserError(f"--save-every {save_every} must be a multiple of --num-iterations {self.k}: a "
                            "checkpoint falls between rollouts")

    def take(self, step: int, roll_out: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """A micro-batch's batch at optimizer step `step`: at the first of a rollout's K steps,
        `roll_out()`'s, kept; at the next K-1, the kept one of the same micro-batch, taken back."""
        if step != self.at:  # a step's first micro-batch
            self.at, self.slot = step, 0
            if self.between_rollouts(step):
                self.kept = []
        self.slot += 1
        if not self.between_rollouts(step):
            return dict(self.kept[self.slot - 1])  # the trainer takes the labels out of its copy
        out = roll_out()
        self.kept.append(dict(out))
        return out


class Rollouts:
    """The batch source of a GRPO run: a batch of prompts in, the step's batch out (see the module
    docstring). One per worker, made by `GroupObjective.batch_source`."""

    def __init__(self, objective: GroupObjective, engine: Any, tokenizer: Any, data: Any, model: Any,
                 total_steps: int = 0, initial: Any = None) -> None:
        import contextlib

        from ..kernels.generate import Sampling

        self.objective, self.engine, self.data = objective, engine, data
        plain = engine.unwrap_model(model)
        self.eos = end_ids(tokenizer, plain)
        self.tokenizer = left_padded(tokenizer, self.eos)  # decodes; its pad token fills ended rows
        own = objective.settings
        self.sampling = Sampling(own.max_completion_length, self.eos, self.tokenizer.pad_token_id, own.temperature,
                                 own.top_p, own.top_k)
        self.greedy = dataclasses.replace(self.sampling, temperature=0.0)
        # Eager devices (the CPU, CUDA) stop a rollout once every row has ended and cut the update's
        # rows after the longest completion (what is cut is padding, out of the loss); XLA keeps
        # one shape, so one graph. Only where each process's forward passes are its own (no
        # `agreement`): under FSDP2, --tensor-parallel, --context-parallel or --expert-parallel
        # every forward calls collectives, so the processes decode the same number of steps (else
        # gloo's collectives mismatch) and keep rows of one width
        strategy = engine.strategy
        self.agree = agreement(engine)  # the tool loop's turns in step over the processes
        self.eager = not engine.accelerator.static_shapes and self.agree is None
        # There, uncompiled, a group's prompt passes once (`shared`), and on XLA where the mesh
        # splits rows only; in one process over a base not held in 8 or 4 bits, the rollout runs
        # in inference mode too (`generating`)
        from ..models import holds_quantized_base

        self.lean = self.eager and not engine.accelerator.compiling
        self.rows_only = engine.accelerator.static_shapes and self.agree is None and not strategy.axes.split
        self.inference = self.lean and strategy.world_size == 1 and not holds_quantized_base(plain)
        self.state = TrainerState(max_steps=total_steps)
        # each split's rows' columns, read at first use
        self.columns: dict[str, list[dict] | None] = dict.fromkeys(data)
        self.iterations = Iterations(own.num_iterations)  # --num-iterations: K updates on each rollout
        toolbox = own.toolbox  # --tools: rollouts in turns, the tools run between them (tasks/tools.py)
        self.loop, self.environments = None, None
        # processes that read the same rows (SPMD's hosts, a tensor or context group) each run those
        # rows' tools and resets: their answers must agree, or so would not the rows
        if toolbox is not None and strategy.peers > 1 and (strategy.world_size == 1 or strategy.axes.inner > 1) \
                and engine.is_main_process:
            print("xla-train: warning: --tools/--environment: the processes that read the same rows (several hosts "
                  "under SPMD, a tensor or context group) each run those rows' tool calls and resets; a tool or "
                  "reset must answer the same call alike (no clock or unseeded randomness), or their rows differ",
                  file=sys.stderr)
        if toolbox is not None:
            toolbox.check(self.tokenizer)
            self.loop = ToolLoop(self.tokenizer, toolbox, own.max_tool_calling_iterations)
            if toolbox.environment is not None:  # --environment: its pool, this worker's
                self.environments = Environments(toolbox)
        self.warned = False  # a reset's text made a prompt longer than --max-length (warned once)
        # beta > 0: the reference, the model with its adapters disabled (--lora), else a frozen copy
        # of the model as training began (`initial`: its loading again, prepared for the device)
        self.reference, self.unadapted = None, contextlib.nullcontext
        if own.beta:
            peft = peft_model_of(model)
            if peft is not None:
                self.reference, self.unadapted = model, peft.disable_adapter
            else:
                assert initial is not None  # the trainer gives it (Objective.batch_source)
                self.reference = initial()

    def __call__(self, model: Any, batch: dict[str, Any], split: str = "train", step: int = 0,
                 epoch: float = 0.0) -> dict[str, Any]:
        """The step's batch from a batch of prompts: its rollout (`rollout`), or with
        --num-iterations K at the later K-1 of a rollout's steps the kept one (`Iterations`).
        Evaluation rolls out every batch."""
        if split != "train" or self.iterations.k == 1:
            return self.rollout(model, batch, split, step, epoch)
        return self.iterations.take(step, lambda: self.rollout(model, batch, split, step, epoch))

    def rollout(self, model: Any, batch: dict[str, Any], split: str = "train", step: int = 0,
                epoch: float = 0.0) -> dict[str, Any]:
        """The step's batch from a batch of prompts: the rollout, its rewards and advantages; with
        --num-iterations > 1, the log-probabilities the completions were sampled with (a forward
        pass without gradients, as TRL's). Evaluation (`split` not train): one greedy completion
        per prompt, scored."""
        import torch

        from ..kernels.generate import static_generate

        training = split == "train"
        group = self.objective.settings.num_generations if training else 1
        ids, mask = (batch[k].repeat_interleave(group, 0) for k in ("input_ids", "attention_mask"))
        plain = self.engine.unwrap_model(model)
        self.state.global_step, self.state.epoch = step, epoch
        if self.loop is not None:
            return self.played(model, batch, ids, mask, split, group)
        was_training = model.training
        model.eval()
        # in the update's precision (bf16 autocast where asked, as predictions generate): the sampler is the
        # trainer; training keeps each token's log-probability as the decode graph drew it
        with self.generating():
            generated = static_generate(plain, ids, mask, self.sampling if training else self.greedy,
                                        self.engine.cut_graph, logps=training, stop_when_done=self.eager,
                                        group=self.shared(group), split_rows=self.engine.strategy.split_rows)
        tokens, drawn = (outside(x) for x in (generated if training else (generated, None)))
        model.train(was_training)
        # the one transfer of the rollout: the row numbers and the completions' tokens, for the rewards
        rows_and_tokens = torch.cat([batch["row"].repeat_interleave(group, 0)[:, None], tokens], 1)
        host = self.engine.to_host([rows_and_tokens])[0]  # split over devices (SPMD): shard by shard
        per_function, rewards, metrics = self.score(host[:, 0].tolist(), host[:, 1:], split, group)
        advantages = self.objective.advantages(rewards, group)
        if self.eager:  # the update's rows end with the longest completion, as TRL pads them
            is_eos = torch.isin(host[:, 1:], torch.tensor(self.eos))
            lengths = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, is_eos.shape[1])
            width = int(lengths.max())
            tokens, drawn = tokens[:, :width], None if drawn is None else drawn[:, :width]
        out = self.batch(ids, mask, tokens, (advantages, metrics, rewards, per_function), training)
        if training:
            self.log_probabilities(model, out, drawn)
        return out

    @contextlib.contextmanager
    def generating(self) -> Any:
        """Where rollouts run: without gradients, under the update's autocast (the sampler is the
        trainer); where `inference` says, in the engine's inference mode, which spares every one of the rollout's
        many small operations autograd's bookkeeping (benchmarks/bench_rollout.py: 1.10x on top of
        `shared`'s 1.10x on the CPU). What the update reads of it is copied out first (`outside`).
        Only in one process that runs eagerly, uncompiled, over a base in full precision: a tensor a
        module makes or replaces during the rollout stays an inference tensor, which the update
        could not save for its backward pass nor write in place. bitsandbytes' Linear4bit repacks
        its weight in eval mode on CPUs with AVX512-BF16 and casts its bias (0.50's
        nn/modules.py); DDP writes buffers in place before each forward pass (a rotary embedding's
        `inv_freq` that a dynamic scaling made anew); FSDP2 gathers parameters into buffers it
        keeps; under --compile a graph traced in one mode is guarded against the other."""
        import torch

        with self.engine.inference_mode() if self.inference else torch.no_grad(), self.engine.autocast():
            yield

    def shared(self, group: int) -> int:
        """How many rows in a row share one prompt's pass (kernels.generate.prefill): a group's
        where each process's forward passes are its own, on a device that runs eagerly, uncompiled
        (`lean`; under --compile the copied caches would lose the static addresses CUDA graphs
        keep), or on XLA where the mesh splits rows only (`rows_only`: xmp.spawn's replicas, one
        device, or SPMD's data and fsdp axes). There the pass, the pick of a row a group and the
        copies are in the prompt's graph (one a bucket, as before), and the copies are laid out
        as the batch's rows (Strategy.split_rows), so the one-token step is the graph it was.
        Else 1: a tensor, context or expert axis splits the caches' heads or tokens too, which
        the copies' layout would have to keep (not built)."""
        return group if self.lean or self.rows_only else 1

    def played(self, model: Any, batch: dict[str, Any], ids: Any, mask: Any, split: str, group: int) -> dict[str, Any]:
        """`rollout` with --tools: the completions made in turns, the tools run between them
        (tasks/tools.py ToolLoop, kernels/generate.py Turns: one transfer to the host per turn),
        then scored and batched as `rollout`'s, the tools' results in the rows but out of the loss."""
        import torch

        from ..kernels.generate import Turns

        assert self.loop is not None
        training = split == "train"
        rows = batch["row"].repeat_interleave(group, 0)
        environments = observations = schemas = None
        if self.environments is not None:  # reset before the rollout, each with its row (one more transfer)
            environments, observations, schemas, ids, mask = self.reset(self.engine.to_host([rows])[0].tolist(),
                                                                        ids, mask, split)
        was_training = model.training
        model.eval()
        with self.generating():  # as `rollout`'s: the update's precision, each drawn logp kept
            turns = Turns(self.engine.unwrap_model(model), ids, mask, self.sampling if training else self.greedy,
                          self.engine.cut_graph, stop_when_done=self.eager, logps=training,
                          group=1 if self.environments is not None else self.shared(group),
                          split_rows=self.engine.strategy.split_rows)
            played = self.loop(turns, ids, mask, self.engine.to_host, rows, environments, self.agree, schemas)
        model.train(was_training)
        per_function, rewards, metrics = self.score(played.extra.tolist(), None, split, group, played,
                                                    environments, observations)
        advantages = self.objective.advantages(rewards, group)
        lengths = torch.tensor(played.lengths)
        kept = torch.arange(played.tokens.shape[1])[None] < lengths[:, None]
        last = played.tokens.gather(1, (lengths - 1).clamp(min=0)[:, None])
        ended = (last == torch.tensor(self.eos)).any(1, keepdim=True) & (lengths[:, None] > 0)
        parts = [outside(played.tokens), outside(played.made), kept, ended]
        drawn = outside(turns.drawn)
        if self.eager:  # the update's rows end with the longest completion, as TRL pads them
            width = max(max(played.lengths), 1)
            parts = [x[:, :width] for x in parts[:3]] + [ended]
            drawn = None if drawn is None else drawn[:, :width]
        tokens, made, kept, ended = (x.to(ids.device) for x in parts)
        out = self.batch(ids, mask, tokens, (advantages, metrics, rewards, per_function), training, (made, kept, ended))
        if training:
            self.log_probabilities(model, out, drawn)
        return out

    def reset(self, rows: list[int], ids: Any, mask: Any, split: str) -> tuple[list, list, list, Any, Any]:
        """--environment: each completion's instance, reset with its row's columns, what each reset
        returned and the row's tools' schemas (its environment's); where a reset returned text,
        the prompts rendered again with it appended to their last message (TRL's), kept to their
        last --max-length tokens and left-padded: to --max-length where shapes are static (one
        shape), else to the longest."""

        assert self.environments is not None and self.loop is not None
        found = [self.table(split)[r] for r in rows]
        environments, observations = self.environments.reset(found)
        schemas = [self.loop.toolbox.schemas_of(f, f["_where"]) for f in found]
        if all(o is None for o in observations):
            return environments, observations, schemas, ids, mask
        limit = self.objective.max_length
        prompts, cut = observed_prompts(self.tokenizer, found, observations, schemas, limit)
        if cut and not self.warned:  # as the prompts' first rendering says
            self.warned = True
            print(f"xla-train: warning: --environment: a prompt with its reset's text is longer than --max-length "
                  f"{limit}; it keeps its last {limit} tokens (raise --max-length to keep all)", file=sys.stderr)
        new_ids, new_mask = left_pad(prompts, limit if not self.eager else max(map(len, prompts)),
                                     self.tokenizer.pad_token_id)
        return environments, observations, schemas, new_ids.to(ids.device), new_mask.to(mask.device)

    def table(self, split: str) -> list[dict]:
        """The split's rows' columns (read at first use)."""
        table = self.columns[split]
        if table is None:
            table = self.columns[split] = [json.loads(x) for x in self.data[split][EXTRA]]
        return table

    def log_probabilities(self, model: Any, batch: dict[str, Any], drawn: Any) -> None:
        """The completions' log-probabilities that stay fixed through the rollout's updates, as
        TRL's `_generate_and_score_completions` takes them: the policy's as sampled (with
        --num-iterations > 1; else the update's own, detached) and the reference's (beta > 0);
        and `drawn`, the sampler's ([rows, completion], as the decode graph drew each token; 0
        where it drew none), put at the labels' positions (`batch`) for the sampling/* metrics."""
        import torch

        objective, rollout = self.objective, batch["labels"]
        ids = batch["input_ids"]
        edge = torch.zeros(len(ids), 1, device=ids.device)
        rollout.sampled = torch.cat([edge.expand(-1, ids.shape[1] - drawn.shape[1] - 1), drawn, edge], 1)
        inputs = {k: v for k, v in batch.items() if k != "labels"}

        def logps(model):
            head = run_documents(model, inputs, objective.attention)
            return objective.token_logps(head, rollout.labels, objective.settings.temperature)

        with torch.no_grad(), self.engine.autocast():
            if objective.settings.num_iterations > 1:
                rollout.old = logps(model)
            if self.reference is not None:
                with self.unadapted():
                    rollout.reference = logps(self.reference)

    def score(self, rows: list[int], tokens: Any, split: str, group: int,
              played: Any = None, environments: list | None = None,
              observations: list | None = None) -> tuple[Any, Any, Any]:
        """Every completion's rewards, per function ([completions, functions], NaN for None) and
        their weighted sum (NaN-skipping, as TRL's nansum), and the rollout's metrics (ROLLOUT_KEYS,
        then each function's mean and std, then with --tools TOOL_METRICS). `played`: a rollout
        with tools (tasks/tools.Played): its completions are lists of turns, its lengths count
        the model's tokens only (TRL's, through tool_mask). `environments`: each completion's
        (--environment), given to the reward functions as TRL gives them, with the prompts as
        their resets' `observations` left them."""
        import torch

        table = self.table(split)
        texts, ids, ended = [], [], []
        if played is None:
            for row in tokens.tolist():
                end = next((i for i, t in enumerate(row) if t in self.eos), None)
                texts.append(self.tokenizer.decode(row[:end], skip_special_tokens=True))
                ids.append(row if end is None else row[:end + 1])  # the end-of-sequence token counted
                ended.append(end is not None)
            counts = torch.tensor([len(x) for x in ids], dtype=torch.float32)
        else:
            ids = [row[:n] for row, n in zip(played.tokens.tolist(), played.lengths)]
            ended = [bool(x) and x[-1] in self.eos for x in ids]
            counts = played.made.sum(1).float()
        found = [table[r] for r in rows]
        prompts = [observed(f["prompt"], o) for f, o in zip(found, observations or [None] * len(found))]
        keys = [k for k in found[0] if k not in ("prompt", "completion", "completion_ids", "_where")]
        columns = {k: [f.get(k) for f in found] for k in keys}
        if environments is not None:
            columns["environments"] = environments
        completions = completions_of(prompts, texts) if played is None else played.completions
        per_function, _ = score(self.objective.rewards, prompts, completions, ids, columns,
                                self.state, [f["_where"] for f in found])
        values = torch.tensor(per_function, dtype=torch.float32)  # [completions, functions]
        rewards = total(self.objective.rewards, values)
        grouped = rewards.view(-1, group)
        std = grouped.std(1) if group > 1 else torch.zeros(len(grouped))
        metrics = [rewards.mean(), std.mean(), torch.isclose(std, torch.zeros_like(std)).float().mean(),
                   counts.mean(), counts.min(), counts.max(), 1 - torch.tensor(ended, dtype=torch.float32).mean()]
        for column in values.T:
            metrics += [column.nanmean(), _nanstd(column)]
        if played is not None:
            metrics += [torch.tensor(v) for v in played.calls.frequencies(len(ids))]
        return values, rewards, torch.stack(metrics)

    def batch(self, ids: Any, mask: Any, tokens: Any, scored: tuple, training: bool,
              turns: tuple | None = None) -> dict[str, Any]:
        """The update's inputs: prompt and completion in one row, positions from the prompt's first
        token, segment 1 for real tokens (padding 0); labels the completion's tokens up to its first
        end-of-sequence token (shifted: a token's label is the next token). `turns` (--tools): which
        tokens the model made, which the row holds and whether it ended, as the tool loop left
        them: the tools' results are in the row and out of the labels (TRL's tool_mask)."""
        import torch

        device = ids.device
        own = self.objective.settings
        if turns is None:
            eos = torch.tensor(self.eos, device=device)
            is_eos = (tokens[..., None] == eos).any(-1)
            after = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # past the first end-of-sequence token
            made = kept = ~after
            ended = is_eos.any(1, keepdim=True)
        else:
            made, kept, ended = (x.bool() for x in turns)
        trained = made & kept
        if own.mask_truncated_completions and training:
            trained = trained & ended
        real = torch.cat([mask.bool(), kept], 1)
        length = ids.shape[1]
        labels = torch.full_like(real, IGNORE, dtype=torch.long)
        labels[:, length - 1:-1] = torch.where(trained, tokens, torch.full_like(tokens, IGNORE))
        normalizer = trained.sum().float()
        if training and own.loss_type in STEP_TOKENS and self.engine.strategy.peers > 1:
            normalizer = self.engine.strategy.gather(normalizer[None]).mean()  # the step's tokens per replica
        sizes = [t.numel() for t in scored]
        parts = torch.cat([t.reshape(-1) for t in scored]).to(device).split(sizes)  # one copy to the device
        advantages, metrics, rewards, per_function = parts
        rollout = Rollout(labels, advantages, normalizer, metrics, rewards, per_function.view(len(rewards), -1))
        if not training:  # evaluation scores the completions; the policy need not run
            return {"labels": rollout}
        return {"input_ids": torch.cat([ids, tokens], 1), "position_ids": (real.long().cumsum(1) - 1).clamp(min=0),
                "segments": real.long(), "labels": rollout}


def outside(x: Any) -> Any:
    """A rollout's tensor as one autograd may use: a copy where inference mode made it
    (Rollouts.generating), which the update cannot save for its backward pass."""
    return x.clone() if x is not None and x.is_inference() else x


def high_entropy_mask(entropy: Any, mask: Any, quantile: float) -> Any:
    """The completion tokens whose entropy is at least the `quantile` of the tokens' entropies
    (torch.quantile's linear interpolation), as TRL 1.16's GRPOTrainer.get_high_entropy_mask; in
    static shapes (no boolean indexing: the masked entropies sorted after the real ones, the
    quantile read at device indices). Over the micro-batch the loss sees: the global batch under
    SPMD, one replica's elsewhere (TRL gathers every process's)."""
    import torch

    real = mask.bool()
    values = torch.where(real, entropy.float(), math.inf).flatten().sort().values
    position = quantile * (real.sum() - 1).float()
    low, high = (torch.clamp(f(position).long(), 0, values.numel() - 1) for f in (torch.floor, torch.ceil))
    below, above = values.gather(0, torch.stack([low, high]))  # (values[low] would read `low` on the host)
    threshold = below + (above - below) * (position - low.float())
    return (entropy * mask >= threshold) & real


def sampling_metrics(sampled: Any, trained: Any, mask: Any) -> dict[str, Any]:
    """The sampler's log-probabilities of the completion tokens (the decode graph's, as it drew
    them) against the trainer's (the full forward's, at the same weights), under TRL 1.16's names
    (_generate_and_score_completions, where it compares vLLM's to its own): the absolute
    difference's mean and max over the completion tokens, and the importance ratio
    exp(sum of trainer - sampler) per completion, TRL's default (sequence) granularity before its
    masking (nothing is corrected here: the sampler is the trainer)."""
    import torch

    share = mask.sum().clamp(min=1)
    difference = (trained - sampled).abs() * mask
    ratio = torch.exp(((trained - sampled) * mask).sum(-1))
    return {"sampling/sampling_logp_difference/mean": difference.sum() / share,
            "sampling/sampling_logp_difference/max": difference.max(),
            "sampling/importance_sampling_ratio/min": ratio.min(),
            "sampling/importance_sampling_ratio/mean": ratio.mean(),
            "sampling/importance_sampling_ratio/max": ratio.max()}


def _nanstd(x):
    import torch

    x = x[~torch.isnan(x)]
    return x.std() if len(x) > 1 else torch.zeros(())


# ---------------------------------------------------------------------------------------------
# The objective


@dataclass
class PolicyOutput:
    """The policy's head input (causal_lm.HeadInput, or the model's output); the loss keeps its
    metrics here for `step_metrics`."""

    head: Any
    metrics: dict[str, Any] | None = None


@dataclass(frozen=True)
class GroupObjective(Objective):
    """TRL's GRPO loss over a rollout's completions (`Rollouts` makes the batch)."""

    attention: str = "auto"
    settings: GRPOOptions = GRPOOptions()
    rewards: tuple[Reward, ...] = ()
    router_aux_loss_coef: float | None = None  # the routers' loss weight (None: the model config's)
    max_length: int = 128  # --max-length: a prompt's tokens (an --environment's prompts are rendered again)

    @property
    def updates_per_batch(self) -> int:
        """--num-iterations K: each step's prompts come K steps in a row (Iterations)."""
        return self.settings.num_iterations

    def batch_source(self, engine: Any, tokenizer: Any, data: Any, model: Any, total_steps: int,
                     initial: Any = None) -> Rollouts:
        return Rollouts(self, engine, tokenizer, data, model, total_steps, initial)

    def memory_inputs(self, model: Any, device_kind: str, length: int) -> PassInputs:
        """The causal-LM forward's over a prompt bucket plus a completion; the rollout's key/value
        cache; with beta > 0 and no adapters, the reference's frozen copy of the weights. (The
        reference pass runs at the rollout, without gradients: its log-probabilities are all the
        update keeps of it.)"""
        if self.settings.environment:  # a rollout whose resets returned text: its prompts at --max-length
            length = max(length, self.max_length)
        length = length + self.settings.max_completion_length
        path = documents_memory_inputs(model, device_kind, length, self.attention)
        copy = bool(self.settings.beta) and peft_model_of(model) is None
        return dataclasses.replace(path, length=length, cache_tokens=length, reference_copy=copy)

    @staticmethod
    def token_logps(head: Any, labels: Any, temperature: float = 1.0) -> Any:
        """Each label's log-probability, [rows, length] fp32 (0 where the label is IGNORE), under
        the logits divided by the sampling `temperature` (TRL's GRPO: the distribution the
        completions were drawn from)."""
        import torch.nn.functional as F

        from ..kernels.lm_loss import chunked_token_losses

        if isinstance(head, HeadInput):
            return -chunked_token_losses(head.hidden, head.weight, labels, head.bias, head.softcap,
                                         ignore_index=IGNORE, temperature=temperature)
        logits = head.logits.float() / temperature
        return -F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none")

    @staticmethod
    def token_entropy(head: Any, temperature: float = 1.0) -> Any:
        """Each position's predictive entropy, [rows, length] fp32, without gradients."""
        import torch

        from ..kernels.lm_loss import chunked_entropy

        if isinstance(head, HeadInput):
            return chunked_entropy(head.hidden, head.weight, head.bias, head.softcap, temperature=temperature)
        with torch.no_grad():
            logp = (head.logits.float() / temperature).log_softmax(-1)
            return -(logp.exp() * logp).sum(-1)

    def forward(self, model: Any, inputs: dict[str, Any]) -> PolicyOutput | None:
        """The policy on the rollout's rows (causal_lm.run_documents: the final hidden states and
        the head, the head computed in chunks; a mixture of experts' routers' loss over the prompts'
        and completions' real tokens). An evaluation's rollout has no rows to run: None."""
        if "input_ids" not in inputs:
            return None
        weight = router_weight(model, self.router_aux_loss_coef)
        return PolicyOutput(run_documents(model, inputs, self.attention, router_weight=weight))

    def advantages(self, rewards: Any, group: int) -> Any:
        """Each reward less its group's mean, scaled as --scale-rewards says (TRL's 1e-4 guard)."""
        grouped = rewards.view(-1, group)
        centred = (grouped - grouped.mean(1, keepdim=True)).view(-1)
        if self.settings.scale_rewards == "none" or group < 2:
            return centred
        std = grouped.std(1).repeat_interleave(group) if self.settings.scale_rewards == "group" else rewards.std()
        return centred / (std + 1e-4)

    def policy_loss(self, logps: Any, rollout: Rollout, reference: Any = None, old: Any = None,
                    entropy: Any = None) -> tuple[Any, dict[str, Any]]:
        """TRL 1.16's `_compute_loss` (trainer/grpo_trainer.py), each --loss-type: the importance
        ratio per token or per sequence, the loss type's per-token term (the clipped surrogate,
        cispo's capped ratio, sapo's soft gate, vespo's gamma weight), the top-entropy mask, plus
        beta times the k3 KL estimate weighted by the ratio, normalised per --loss-type; and its
        metrics under TRL's names. `old`: the log-probabilities the completions were sampled with,
        where they differ from the policy's now (None: the same, detached); `entropy`: each
        position's, [rows, length] (needed with --top-entropy-quantile below 1)."""
        import torch

        own = self.settings
        mask = (rollout.labels != IGNORE).float()
        old = logps.detach() if old is None else old  # one update per rollout: the ratio is 1, its gradient not
        log_ratio = logps - old
        if own.importance_sampling_level == "sequence":  # GSPO: one ratio per completion, [rows, 1]
            log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
        ratio = torch.exp(log_ratio)
        advantages = rollout.advantages[:, None]
        metrics = {}
        if own.loss_type == "cispo":
            per_token = -torch.clamp(ratio, max=own.upper).detach() * advantages * logps
        elif own.loss_type == "sapo":
            temperatures = torch.where(advantages > 0, own.sapo_temperature_pos, own.sapo_temperature_neg)
            per_token = -torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages
        elif own.loss_type == "vespo":
            phi = self.gamma_weights(advantages, logps - old, mask)
            per_token = -phi * advantages * logps
            metrics["vespo/phi_seq_mean"] = phi.mean()
        else:  # grpo, bnpo, dr_grpo, dapo, luspo: the clipped surrogate
            clipped = torch.clamp(ratio, 1 - own.epsilon, 1 + own.upper)
            per_token = -torch.min(ratio * advantages, clipped * advantages)
        if own.top_entropy_quantile < 1:
            per_token = per_token * high_entropy_mask(entropy, mask, 1 - own.top_entropy_quantile)
        if own.beta:  # the k3 estimate, times the ratio (TRL's use_bias_correction_kl, its default)
            delta = reference - logps
            kl = (torch.exp(delta) - delta - 1) * ratio
            per_token = per_token + own.beta * kl
            metrics["kl"] = (kl * mask).sum() / mask.sum().clamp(min=1)
        masked = per_token * mask
        if own.loss_type in ("grpo", "sapo"):
            loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        elif own.loss_type == "bnpo":
            loss = masked.sum() / mask.sum().clamp(min=1)
        elif own.loss_type == "dr_grpo":
            loss = masked.sum() / (masked.shape[0] * own.max_completion_length)
        elif own.loss_type == "luspo":
            loss = masked.sum(-1).mean()
        else:  # STEP_TOKENS
            loss = masked.sum() / rollout.normalizer.clamp(min=1)
        metrics.update(self.clip_metrics(ratio, advantages, mask))
        return loss, metrics

    def clip_metrics(self, ratio: Any, advantages: Any, mask: Any) -> dict[str, Any]:
        """The clipped share under TRL's names: per token, or per completion where the ratio is
        per sequence ([rows, 1]: TRL's global_masked_mean, masked_seq_mean); cispo's capped share."""
        import torch

        own = self.settings

        def mean(x):  # over the completion tokens, or over the rows where x is one per row
            if x.shape[1] == 1:
                return x.float().mean()
            return (x * mask).sum() / mask.sum().clamp(min=1)

        if own.loss_type == "cispo":
            return {"cispo_clip_ratio": mean(((ratio > own.upper) & (advantages > 0)).float())}
        if own.loss_type in ("sapo", "vespo"):
            return {}
        low = ((ratio < 1 - own.epsilon) & (advantages < 0)).float()
        high = ((ratio > 1 + own.upper) & (advantages > 0)).float()
        # each completion's share; per token, rows without tokens are skipped (TRL's NaN, which its nanmin skips)
        rows = mask.sum(-1) > 0 if ratio.shape[1] > 1 else torch.ones_like(mask[:, 0], dtype=torch.bool)

        def per_row(x):
            return x[:, 0] if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)

        inf = torch.full_like(rows, math.inf, dtype=torch.float32)
        low_min = torch.where(rows, per_row(low), inf).min()
        high_max = torch.where(rows, per_row(high), -inf).max()
        anything = rows.any()  # a running sum must not take an infinity: 0 where no row has a token
        return {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                "clip_ratio/region_mean": mean(((low + high) > 0).float()),
                "clip_ratio/low_min": torch.where(anything, low_min, 0.0),
                "clip_ratio/high_max": torch.where(anything, high_max, 0.0)}

    def gamma_weights(self, advantages: Any, log_ratio: Any, mask: Any) -> Any:
        """VESPO's weight of each completion, [rows, 1], without gradients: phi(w) = e^lambda w^k
        e^(-lambda w) of the sequence's ratio w = exp(sum of the token log-ratios), k and lambda by
        the advantage's sign; TRL 1.16's GRPOTrainer.get_gamma_weights, in log space with its
        clamps, without its vLLM correction (the sampler is the trainer here)."""
        import torch

        own = self.settings
        with torch.no_grad():
            lower = math.log(1e-8)
            log_w = torch.clamp((torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True), lower, 20.0)
            positive = advantages >= 0
            k = torch.where(positive, own.vespo_k_pos, own.vespo_k_neg)
            lam = torch.where(positive, own.vespo_lambda_pos, own.vespo_lambda_neg).clamp(min=1e-4)
            return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def loss(self, output: PolicyOutput, labels: Rollout) -> Any:
        """The step's loss on a rollout (`labels`), plus the routers' weighted load-balancing loss
        where the forward computed it (TRL's GRPOTrainer adds it so); its metrics kept on `output`:
        the loss's, `entropy`, and the sampler's log-probabilities against the update's
        (`sampling_metrics`)."""
        temperature = self.settings.temperature
        logps = self.token_logps(output.head, labels.labels, temperature)
        entropy = self.token_entropy(output.head, temperature)
        loss, output.metrics = self.policy_loss(logps, labels, labels.reference, labels.old, entropy)
        mask = (labels.labels != IGNORE).float()
        output.metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        if labels.sampled is not None:
            output.metrics.update(sampling_metrics(labels.sampled, logps.detach() if labels.old is None
                                                   else labels.old, mask))
        output.metrics.update(router_metrics(output.head))
        return with_router_loss(loss, output.head)

    def step_metrics(self, output: Any, labels: Any) -> dict[str, Any] | None:
        names = [*ROLLOUT_KEYS, *(f"rewards/{r.name}/{s}" for r in self.rewards for s in ("mean", "std")),
                 *(TOOL_METRICS if self.settings.tools or self.settings.environment else ())]
        return {**dict(zip(names, labels.metrics.unbind())), **output.metrics}

    # --- evaluation: the validation prompts' greedy completions, scored -----------------------
    def keys(self) -> list[str]:
        return ["reward", *(f"rewards/{r.name}/mean" for r in self.rewards), "completions/mean_length"]

    def load_metric(self) -> None:
        return None

    def eval_columns(self, batch: dict[str, Any], output: Any) -> tuple:
        """Per validation prompt: its greedy completion's reward, each function's, its length."""
        rollout = batch["labels"]
        return (rollout.rewards, *rollout.per_function.T, (rollout.labels != IGNORE).sum(1).float())

    def score(self, metric: Any, columns: tuple) -> dict[str, float]:
        n = len(columns[0])
        return {**{k: float(c.double().nanmean()) if n else math.nan for k, c in zip(self.keys(), columns)}, "n": n}


@dataclass
class ScoredSamples(Samples):
    """--eval-samples of a GRPO run: each validation prompt's greedy completion with its rewards."""

    rewards: tuple[Reward, ...] = ()

    def generator(self, engine: Any) -> Any:
        generate = super().generator(engine)

        def scored(model: Any) -> list[dict]:
            rows = generate(model)
            texts = [row["completion"] for row in rows]
            prompts = [row["prompt"] for row in rows]
            columns = {k: [row.get(k) for row in rows] for k in rows[0] if k not in ("prompt", "completion")}
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            values, _ = score(self.rewards, prompts, completions_of(prompts, texts), ids, columns, TrainerState(),
                              [f"--eval-samples: validation row {i + 1}" for i in range(len(rows))])
            for row, per_function, reward in zip(rows, values, total(self.rewards, values).tolist()):
                row["reward"] = reward
                row.update({f"rewards/{r.name}": v for r, v in zip(self.rewards, per_function)})
            return rows

        return scored


@dataclass
class PlayedSamples(ScoredSamples):
    """--eval-samples of a GRPO run with --tools or --environment: each sample's greedy completion
    made as the evaluation makes it (the tool loop; its environment reset with its row), shown as
    its list of turns, scored. Every process completes every sample (a few rows: the same forward
    passes on each, so collectives meet), their rows repeated up to a multiple of the devices a
    process drives (SPMD's partitioner failed a check on 3 rows over 4 XLA:CPU devices)."""

    settings: GRPOOptions = GRPOOptions()
    prompt_length: int = 128  # --max-length: a prompt's tokens

    def generator(self, engine: Any) -> Any:
        import torch

        from ..kernels.generate import Turns

        toolbox = self.settings.toolbox
        assert toolbox is not None
        tokenizer = left_padded(self.tokenizer, self.sampling.eos_ids)
        toolbox.check(tokenizer)
        loop = ToolLoop(tokenizer, toolbox, self.settings.max_tool_calling_iterations)
        pool = Environments(toolbox) if toolbox.factories else None
        agree = agreement(engine)  # every process runs the same rows, but a count read apart could differ
        stop = not engine.accelerator.static_shapes and agree is None  # as Rollouts' `eager`
        found = [{**row, "_where": f"--eval-samples: validation row {i + 1}"} for i, row in enumerate(self.shown)]
        found += found[-1:] * (-len(found) % engine.strategy.devices_per_process)  # their results are dropped

        def played(model: Any) -> list[dict]:
            instances, observations = pool.reset(found) if pool else (None, [None] * len(found))
            schemas = [toolbox.schemas_of(f, f["_where"]) for f in found]
            prompts, _ = observed_prompts(tokenizer, found, observations, schemas, self.prompt_length)
            width = max(map(len, prompts)) if stop else self.prompt_length
            ids, mask = (t.to(engine.device) for t in left_pad(prompts, width, tokenizer.pad_token_id))
            was_training = model.training
            model.eval()
            with torch.no_grad():
                turns = Turns(engine.unwrap_model(model), ids, mask, self.sampling, engine.cut_graph,
                              stop_when_done=stop)
                out = loop(turns, ids, mask, engine.to_host, None, instances, agree, schemas)
            model.train(was_training)
            columns = {k: [f.get(k) for f in found] for k in found[0] if k not in ("prompt", "completion", "_where")}
            if instances is not None:
                columns["environments"] = instances
            values, _ = score(self.rewards, [observed(f["prompt"], o) for f, o in zip(found, observations)],
                              out.completions, [row[:n] for row, n in zip(out.tokens.tolist(), out.lengths)],
                              columns, TrainerState(), [f["_where"] for f in found])
            return [{**shown, "completion": turns_of, "reward": reward,
                     **{f"rewards/{r.name}": v for r, v in zip(self.rewards, per_function)}}
                    for shown, turns_of, per_function, reward in zip(self.shown, out.completions, values,
                                                                     total(self.rewards, values).tolist())]

        return played


# ---------------------------------------------------------------------------------------------
# The model and the kind


@register
@dataclass(frozen=True)
class GRPO(Task):
    """Group relative policy optimisation of a decoder on prompts and reward functions."""

    kind = "grpo"
    Options = GRPOOptions
    form: str | None = None  # "strings" or "conversational"
    files: dict[str, str] | None = None
    attention: str = "auto"
    settings: GRPOOptions = GRPOOptions()
    rewards: tuple[Reward, ...] = ()
    router_aux_loss_coef: float | None = None  # the routers' loss weight (None: the model config's)

    # --- options ----------------------------------------------------------------------------
    @classmethod
    def check_options(cls, opts):
        own = opts.kind_options()
        if opts.batch_size % own.num_generations:
            raise UserError(f"--batch-size {opts.batch_size} (completions per device, TRL's "
                            f"per_device_train_batch_size) must be a multiple of --num-generations "
                            f"{own.num_generations}, so that each prompt's group stays on one device and its "
                            "advantages need no collective")
        if opts.packing is not None:
            raise UserError(f"--{'' if opts.packing else 'no-'}packing: --problem grpo puts a prompt and a completion "
                            "in each row, padded to --buckets")
        if opts.max_new_tokens and not opts.test_file:
            raise UserError("--max-new-tokens applies to --test-file's completions (rollouts take "
                            "--max-completion-length)")
        Iterations(own.num_iterations).check(opts.save_every)

    @classmethod
    def load(cls, source):
        check_own_rows(source, "grpo", "prompts", "GRPO's rows have a 'prompt' column")
        own = source.options.kind_options() if source.options else GRPOOptions()
        splits, files, form = own_splits(source.train_file, source.validation_file, source.seed, form_of, "prompts")
        for line in own.odd_pairings():  # TRL's warnings, once, in the launching process
            print(f"xla-train: warning: {line}", file=sys.stderr)
        return (cls("custom", None, main="reward", max_length=source.max_length, form=form, files=files,
                    attention=source.attention, settings=own, rewards=own.rewards(),
                    router_aux_loss_coef=router_coef_of(source)),
                splits)

    # --- the parts --------------------------------------------------------------------------
    @cached_property
    def rows(self):
        return PromptRows(self.form, self.files, self.settings.num_generations, specs_of(self.settings.tools),
                          self.settings.environment)

    @cached_property
    def objective(self):
        return GroupObjective(None, self.eval_splits, self.attention, self.settings, self.rewards,
                              self.router_aux_loss_coef, self.max_length)

    @cached_property
    def model(self) -> ModelPart:
        return DecoderModel("grpo", self.router_aux_loss_coef)

    @cached_property
    def prediction(self):
        return Completions(self)

    # --- --eval-samples ---------------------------------------------------------------------
    def sample_rows(self, splits, n):
        """The first `n` validation rows (their prompt and the columns the rewards read)."""
        split = splits[self.eval_splits[0]]
        return [{k: v for k, v in row.items() if k != SOURCE_ROW}
                for row in split.select(range(min(n, len(split)))).to_list()]

    def samples(self, rows, tokenizer, model, batch_size):
        """Greedy completions of `rows`' prompts at every evaluation, each with its reward and every
        function's, as training scores them; with --tools or --environment through the tool loop
        (PlayedSamples)."""
        form = "prompt" if self.form == "strings" else "messages"
        where = [f"--eval-samples: validation row {i + 1}" for i in range(len(rows))]
        toolbox = self.settings.toolbox
        if toolbox is None:
            ids = [prompt_ids({form: row["prompt"]}, form, tokenizer, w) for row, w in zip(rows, where)]
            return samples_of(ids, rows, self.settings.max_completion_length, tokenizer, model, self.max_length,
                              batch_size, ScoredSamples, rewards=self.rewards)
        ids = [with_tools(tokenizer, _turns(row["prompt"], w), toolbox.schemas_of(row, w))
               for row, w in zip(rows, where)]
        return samples_of(ids, rows, self.settings.max_completion_length, tokenizer, model, self.max_length,
                          batch_size, PlayedSamples, rewards=self.rewards, settings=self.settings,
                          prompt_length=self.max_length)

    # --- what the output folder records -----------------------------------------------------
    @classmethod
    def claims(cls, config):
        return fine_tuned_decoder(config)

    @classmethod
    def from_config(cls, config, saved):
        return cls(saved.get("task") or "custom", None, main="reward", max_length=saved.get("max_length", 128),
                   form=saved.get("form"))

    def record(self):
        return {"task": self.name, "problem": self.problem, "labels": None, "form": self.form,
                "max_length": self.max_length, "grpo": dataclasses.asdict(self.settings)}

    def describe(self, splits):
        sizes = ", ".join(f"{len(ds)} {split}" for split, ds in splits.items())
        own = self.settings
        return (f"task {self.name}: grpo ({own.loss_type} loss, {own.num_generations} completions of up to "
                f"{own.max_completion_length} tokens per prompt, rewards {', '.join(r.name for r in self.rewards)}) "
                f"on {self.form} prompts; {sizes} prompts")
