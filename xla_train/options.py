"""Every option of `xla-train train` and `xla-train predict`, declared once: default, help, choices
and, for training, the section it belongs to.

The CLI's parsers are built from these dataclasses (`cli.py`), and `validate()` is the one check
of a whole set of options. A YAML recipe (`xla-train train --config recipe.yaml`) holds training's
options by section (`SECTIONS`), or flat: `read_recipe` checks one, `recipe_text` writes one. This module
imports no torch, transformers, datasets or torch_xla (nor yaml until a recipe is read), so
`--help` starts at once.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .core.errors import UserError, check_choice, check_number
from .core.shapes import parse_buckets
from .kernels.attention import PATHS as ATTENTION_PATHS
from .kernels.quant import FOUR_BIT_TYPES, Quant
from .models import BUNDLED_MODEL, bundled_model_path
from .observe.trackers import TRACKERS, trackers
from .parallel.mesh import Mesh
from .tasks import FILE_FORMATS, KINDS, PROBLEMS, TASKS, Source, check_choices, kind_of
from .tasks.declare import flag_name, option

PADDING_MODES = ("buckets", "max_length", "dynamic")
PRECISIONS = ("fp32", "bf16")

OWN = "own"  # the section metadata of TrainOptions.own, the kinds' own options

# The sections of training's options, in a recipe's order, each with what it holds (the
# groups of `xla-train train --help`). Every TrainOptions field names one in its `section`.
SECTIONS: Mapping[str, str] = MappingProxyType({
    "data": "what to train on: the task, its files and columns",
    "shapes": "static shapes: padding, buckets, lengths, packing",
    "model": "the model, its precision and adapters",
    "optimizer": "the optimizer and its schedule: AdamW, linear decay, epochs, batch, steps, seed",
    "evaluation": "evaluations, choosing the best model, generated samples",
    "checkpoints": "the output folder: checkpoints, resume, overwrite",
    "system": "where it runs and what it reports: backend, processes, compilation, trackers, profiles",
})


def backend_option(section: str | None = None) -> Any:
    """--backend, the same for train and predict (the names are checked where they are chosen:
    core/select.py)."""
    return option("auto", "auto | xla | tpu | cuda | cpu (xla: torch_xla; tpu: TorchTPU; auto: a TPU through "
                  "whichever of the two is installed, then CUDA, then CPU)", section=section)


def strategy_option(section: str | None = None) -> Any:
    return option("ddp", "ddp (a replica per device), spmd (XLA: one process shards each batch over all devices) or "
                  "fsdp (the model's weights, gradients and AdamW state sharded over all devices too: FSDPv2 on XLA, "
                  "FSDP2 on CUDA and the CPU)", section=section)


@dataclass
class TrainOptions:
    """`xla-train train`: what to train on, the course's hyperparameters, shapes and the system.

    Flat, as the code reads it (`cfg.lr`); every field belongs to one section of SECTIONS (its
    `section` metadata), the top-level keys of a YAML recipe (`sections`, `from_sections`)."""

    # data: what to train on
    task: str = option(None, f"GLUE task: {', '.join(TASKS)} (default: mrpc; with own files: custom)", section="data")
    data_dir: str = option(None, "the task's folder in GLUE's layout (train.tsv, dev.tsv; MNLI: dev_matched.tsv, "
                           "dev_mismatched.tsv); 'hub' for load_dataset('glue', TASK); default: the MRPC copy "
                           "bundled with the package", section="data")
    train_file: str = option(None, "own training data: .csv, .tsv, .json, .jsonl or .parquet (causal-lm also a "
                             "save_to_disk folder or a hub data set's name)", section="data")
    validation_file: str = option(None, "own validation data, same columns (causal-lm: optional, else one in 20 of the "
                                  "training rows are held out)", section="data")
    text_columns: str = option(None, "own data: A or A,B (default: sentence1,sentence2 if present, else the first "
                               "two text columns, else the first)", section="data")
    label_column: str = option("label", "own data: the label's column (default: label)", section="data")
    problem: str = option(None, f"own data: {' | '.join(PROBLEMS)} (default: float labels make a regression, "
                          "others a classification; causal-lm: instruction fine-tuning of a decoder on messages, "
                          "prompt/completion or text rows)", section="data")
    test_file: str = option(None, "rows to predict with the final (or best) model, written to "
                            "OUTPUT_DIR/predictions.EXT (a GLUE test.tsv: GLUE's submission format); causal-lm: "
                            "prompt or messages rows, completed greedily as xla-train predict does (in the run's "
                            "--precision, the adapters unmerged), into OUTPUT_DIR/predictions.jsonl", section="data")
    # shapes: static shapes on XLA
    padding: str = option("buckets", " | ".join(PADDING_MODES) + " (dynamic: a new graph per batch length on XLA)",
                          PADDING_MODES, section="shapes")
    buckets: str = option("auto", "auto, or lengths like 32,64,96,128", section="shapes")
    max_length: int = option(128, "truncate rows to this length (causal-lm: documents; packed rows are this long)",
                             section="shapes")
    packing: bool = option(None, "causal-lm: whole documents packed into rows of exactly --max-length tokens, each "
                           "attending to itself only (the default); --no-packing: a row per document, padded to "
                           "--buckets", section="shapes")
    compile_seconds: float = option(None, "cost of one compilation for --buckets auto (default: the backend's "
                                    "estimate)", section="shapes")
    # model: the model, its precision and adapters
    model: str = option(None, f"model folder or hub name (default: {BUNDLED_MODEL})", section="model")
    precision: str = option("fp32", " | ".join(PRECISIONS), PRECISIONS, section="model")
    attention: str = option("auto", "causal-lm: how a packed row's documents are kept apart: auto (Pallas flash "
                            "attention with segment ids on a TPU through torch_xla, FlexAttention on CUDA, else the "
                            "mask), mask (the 4-D mask, the reference), flex, pallas", ATTENTION_PATHS,
                            section="model")
    router_aux_loss_coef: float = option(None, "causal-lm, dpo, grpo on a mixture of experts (a config with "
                                         "output_router_logits: Qwen3-MoE, Mixtral, gpt-oss): the weight of the "
                                         "routers' load-balancing loss over the real tokens, added to the training "
                                         "loss and logged as aux_loss, as TRL does (default: the config's "
                                         "router_aux_loss_coef; 0 turns it off)", section="model")
    gradient_checkpointing: bool = option(False, "recompute each transformer block's activations in the backward "
                                          "pass instead of keeping them: less memory, about a third more compute "
                                          "(XLA: torch_xla's checkpoint)", section="model")
    lora: bool = option(False, "train LoRA adapters (peft) and the classification head instead of every weight; "
                        "OUTPUT_DIR holds the adapter", section="model")
    lora_r: int = option(8, "--lora: the adapters' rank", section="model")
    lora_alpha: float = option(16.0, "--lora: the adapters' scale numerator (scale alpha / r)", section="model")
    lora_dropout: float = option(0.05, "--lora: dropout on the adapters' input", section="model")
    lora_targets: str = option(None, "--lora: module names to adapt, comma-separated (default: peft's default for "
                               "the architecture where it has one, else the attention's q/k/v/o projections found "
                               "by name; a mixture of experts' router and experts only when named here)",
                               section="model")
    merge_lora: bool = option(False, "--lora: write the merged whole model to OUTPUT_DIR instead of the adapter "
                              "(plain transformers loads it)", section="model")
    load_in_8bit: bool = option(False, "--lora: keep the frozen base's linear projections in 8 bits (int8, a scale "
                                "per output channel; bitsandbytes' LLM.int8 on CUDA and the CPU), about half "
                                "bf16's bytes", section="model")
    load_in_4bit: bool = option(False, "--lora: keep the frozen base's linear projections in 4 bits "
                                "(--bnb-4bit-quant-type), about a quarter of bf16's bytes", section="model")
    bnb_4bit_quant_type: str = option("nf4", "--load-in-4bit: the 4-bit type, " + " | ".join(FOUR_BIT_TYPES),
                                      FOUR_BIT_TYPES, section="model")
    use_bnb_nested_quant: bool = option(False, "--load-in-4bit: quantize the scales too (double quantization, "
                                        "QLoRA's)", section="model")
    # optimizer: the course's hyperparameters (AdamW, linear schedule, 3 epochs, batch 8)
    epochs: int = option(3, "passes over the training data", section="optimizer")
    batch_size: int = option(8, "per replica", section="optimizer")
    lr: float = option(5e-5, "AdamW's peak learning rate (linear decay to 0)", section="optimizer")
    weight_decay: float = option(0.0, "AdamW's weight decay", section="optimizer")
    warmup_ratio: float = option(0.0, "fraction of the steps with a rising learning rate, in [0, 1)",
                                 section="optimizer")
    grad_accum: int = option(1, "micro-batches per optimizer step", section="optimizer")
    max_grad_norm: float = option(None, "clip gradients to this norm (default: no clipping)", section="optimizer")
    max_steps: int = option(None, "stop after this many optimizer steps (default: all epochs)", section="optimizer")
    seed: int = option(42, "the new head's weights, dropout and the data order", section="optimizer")
    # evaluation: when to evaluate, model selection, generation
    eval_every: int = option(None, "evaluate every N optimizer steps (default: at the end of each epoch)",
                             section="evaluation")
    eval_samples: int = option(None, "causal-lm and dpo: at every evaluation, complete the first N validation prompts "
                               "greedily, up to their reference's length, into OUTPUT_DIR/samples/step-K.jsonl, "
                               "TensorBoard's text tab and the trackers", section="evaluation")
    metric_for_best: str = option(None, "the evaluation metric that ranks models (default: the task's main metric, "
                                  "causal-lm's loss; mse, loss and perplexity are minimised, the others maximised)",
                                  section="evaluation")
    save_best: bool = option(False, "keep the best evaluation's weights: the final model (and --test-file's "
                             "predictions) are the best one's", section="evaluation")
    early_stopping_patience: int = option(None, "stop after this many evaluations without improvement",
                                          section="evaluation")
    max_new_tokens: int = option(None, "causal-lm, --test-file: tokens to generate per row at most (default: 64)",
                                 section="evaluation")
    # checkpoints: the output folder
    output_dir: str = option(None, "local folder or gs://bucket/prefix for checkpoints and the fine-tuned model and "
                             "tokenizer; locally also TensorBoard events (tensorboard/), metrics.json, "
                             "compilations.json, recipe.yaml and report/", section="checkpoints")
    save_every: int = option(None, "steps between checkpoints (default: every epoch)", section="checkpoints")
    keep_last: int = option(2, "complete checkpoints to keep", section="checkpoints")
    resume: bool = option(False, "continue from the latest complete checkpoint in --output-dir (starts from the "
                          "beginning when there is none)", section="checkpoints")
    overwrite: bool = option(False, "replace the run --output-dir holds: its checkpoints, model and logs are removed "
                             "once this run's checks pass (without it, a folder holding a run stops a new one)",
                             section="checkpoints")
    resume_from: str = option(None, "continue from this checkpoint (OUTPUT_DIR/checkpoints/step-N)",
                              section="checkpoints")
    # system: where it runs, and what it tells
    backend: str = backend_option(section="system")
    num_processes: int = option(None, "workers on this host (default: one per TPU core or GPU; 1 on the CPU and "
                                "on XLA:CPU)", section="system")
    strategy: str = strategy_option(section="system")
    tensor_parallel: int = option(1, "--strategy fsdp (xla, cuda, cpu): split each block's attention heads and MLP "
                                  "columns over this many devices (Megatron's layout, from transformers' "
                                  "tensor-parallel plan of the model), a mesh of fsdp x tensor; the rows are split "
                                  "over the fsdp axis only, --batch-size counting a tensor group's rows (default: 1)",
                                  section="system")
    expert_parallel: int = option(1, "--strategy fsdp (xla; cuda and cpu: FSDP2, without tensor or context "
                                  "parallelism): split a mixture of experts' experts over this many "
                                  "devices, E/N each; tokens travel to their experts' devices and back. The axis takes "
                                  "its devices from fsdp's (rows are split over both), as MaxText's does (default: 1)",
                                  section="system")
    context_parallel: int = option(1, "--strategy fsdp (xla; cuda and cpu: causal-lm): split each row's tokens "
                                   "over this many devices, for rows longer than one device holds; attention still "
                                   "sees the whole row (keys and values gathered), documents and positions kept. Its "
                                   "devices see the same rows, --batch-size counting a context group's rows "
                                   "(default: 1)", section="system")
    compile: bool = option(False, "compile the model with torch.compile on the torch-native backends (cuda: with CUDA "
                           "graphs; tpu: TorchTPU's compiler; cpu), one graph per bucket length; xla compiles every "
                           "step already", section="system")
    compile_cache: str = option(None, "keep compiled graphs in this folder across runs, so that the same job run again "
                                "loads them instead of compiling: with --compile on cuda and cpu torch.compile's "
                                "(inductor's FX graph, AOTAutograd and Triton caches); on xla torch_xla 2.9's "
                                "persistent cache, which it writes but cannot load (pytorch/xla#9094), so there it "
                                "saves nothing yet; the metrics count the graphs taken from it (default: none)",
                                section="system")
    data_cache: bool = option(True, "keep the tokenised rows of local data files in datasets' cache folder "
                              "(HF_DATASETS_CACHE or HF_HOME), keyed by the files, the tokenizer and the options that "
                              "shape rows, so that a second run of the same data starts from them; --no-data-cache "
                              "tokenises every time and keeps nothing", section="system")
    tf32: bool = option(False, "cuda: fp32 matrix products on TensorFloat-32 tensor cores "
                        "(torch.set_float32_matmul_precision('high'), as the HF Trainer's tf32); faster, fp32's "
                        "exactness traded for a 10-bit mantissa. Other backends refuse it", section="system")
    log_every: int = option(10, "steps between reads of the loss from the device", section="system")
    metrics_out: str = option(None, "write the run's metrics JSON here; missing folders are made (default: none; "
                              "OUTPUT_DIR/metrics.json is written in any case)", section="system")
    profile_steps: str = option(None, "capture a profile of optimizer steps A to B (A:B, e.g. 12:16) into "
                                "OUTPUT_DIR/profile/ (a local folder or gs://) for TensorBoard's profile plugin, "
                                "one per host", section="system")
    report_to: str = option("tensorboard", f"where the run's scalars go besides TensorBoard: {', '.join(TRACKERS)} "
                            "or none, comma-separated. TensorBoard's events are written to a local output folder "
                            "whatever this says (the report reads them): 'tensorboard' adds nothing, 'none' no "
                            "other tracker", section="system")

    # the chosen kind's own options ({name: value}, those given): a recipe's section named after the kind
    # (`dpo:`, `grpo:`), flat names, or their flags; `kind_options()` reads them with the kind's defaults
    own: dict = field(default_factory=dict, metadata={"section": OWN, "help": "", "choices": None, "required": False,
                                                      "repeat": False})

    def __post_init__(self) -> None:
        self.model = self.model or bundled_model_path()
        own: dict[str, Any] = {}
        for key, value in (self.own or {}).items():  # `problem.name` (a recipe's kind section) is `name`
            kind, _, name = key.rpartition(".")
            own.pop(name if kind == self.problem else key, None)  # a later value overrides (flags a recipe)
            own[name if kind == self.problem else key] = value
        options = kind_of(self.problem).Options  # a value at the kind's default is as good as none
        defaults = {f.name: f.default for f in fields(options)} if options else {}
        self.own = {k: v for k, v in own.items() if k not in defaults or v != defaults[k]}

    def kind_options(self) -> Any:
        """The chosen kind's own options (its `Options` dataclass, defaults where not given), or
        None for a kind without any."""
        options = kind_of(self.problem).Options
        return options(**{k: v for k, v in self.own.items() if "." not in k}) if options else None

    def source(self) -> Source:
        """The data options as a kind's `load` reads them (tasks.Source), these options beside
        them for the kind's own flags."""
        return Source(self.task, self.data_dir, self.train_file, self.validation_file, self.text_columns,
                      self.label_column, self.problem, self.seed, self.max_length, self.packing, self.attention,
                      options=self)

    def section(self, name: str) -> Section:
        """One section's options and values, read-only: `cfg.section("optimizer").lr` (or `["lr"]`).
        What a consumer takes: the model section for the adapters, the checkpoints and evaluation
        sections for the run state."""
        return Section(name, {key: getattr(self, key) for key in section_names(type(self))[_section(name)]})

    def quantization(self) -> Quant | None:
        """The LoRA base's quantization (--load-in-8bit, --load-in-4bit), None for none."""
        if self.load_in_8bit:
            return Quant(8, "int8")
        if self.load_in_4bit:
            return Quant(4, self.bnb_4bit_quant_type, self.use_bnb_nested_quant)
        return None

    def mesh(self) -> Mesh:
        """The axes the run asks for beside the strategy's own, as one value (parallel.mesh)."""
        return Mesh(tensor=self.tensor_parallel, expert=self.expert_parallel, context=self.context_parallel)

    def validate(self):
        """Every check of the options alone (files and data are checked when they are read)."""
        from .core.select import BACKENDS, STRATEGIES

        _check_choices(self, {"padding": PADDING_MODES, "precision": PRECISIONS, "backend": BACKENDS,
                              "strategy": STRATEGIES, "bnb_4bit_quant_type": FOUR_BIT_TYPES})
        _at_least_one(self, ("epochs", "batch_size", "grad_accum", "log_every", "max_length", "tensor_parallel",
                             "expert_parallel", "context_parallel"),
                      ("max_steps", "save_every", "keep_last", "eval_every", "eval_samples", "early_stopping_patience",
                       "max_new_tokens"))
        _check_numbers(self, {  # name: (allowed, what the message says)
            "lr": (lambda x: x > 0, "a positive number"),
            "weight_decay": (lambda x: x >= 0, "a number >= 0"),
            "warmup_ratio": (lambda x: 0 <= x < 1, "in [0, 1)"),
            "max_grad_norm": (lambda x: x > 0, "a positive number"),
            "compile_seconds": (lambda x: x >= 0, "a number of seconds >= 0"),
            "lora_alpha": (lambda x: x > 0, "a positive number"),
            "lora_dropout": (lambda x: 0 <= x < 1, "in [0, 1)"),
            "router_aux_loss_coef": (lambda x: x >= 0, "a number >= 0"),
        })
        self._check_lora()
        if not 0 <= self.seed < 2**32:
            raise UserError(f"--seed must be in [0, 2**32), not {self.seed}")
        check_choices(self.task, self.problem)
        self._check_own()
        kind_of(self.problem).check_options(self)  # the kind's own flags (--packing, --max-new-tokens, ...)
        if self.test_file and not self.output_dir:
            raise UserError("--test-file needs --output-dir, where predictions.EXT is written")
        if self.resume and not self.output_dir:
            raise UserError("--resume needs --output-dir, the folder that holds the checkpoints")
        parse_buckets(self.buckets, self.max_length)
        if self.compile and self.padding == "dynamic":
            raise UserError("--compile needs static shapes: --padding buckets or max_length, not dynamic (a graph "
                            "for every batch length)")
        self._check_observers()
        check_model_path(self.model)
        if self.metrics_out:
            check_output_file(self.metrics_out, "--metrics-out")


    def _check_own(self):
        """The options given of a kind's own are the chosen kind's, each of its type and choices;
        then the kind's own checks of their values (its `Options.check`)."""
        options = kind_of(self.problem).Options
        names = {f.name: f for f in fields(options)} if options else {}
        for key, value in self.own.items():
            kind, _, name = key.rpartition(".")
            if kind:
                raise UserError(f"the recipe's {kind} section applies to --problem {kind}")
            if name not in names:
                owners = [kind for kind, _ in kind_option_fields().get(name, [])]
                if not owners:
                    raise UserError(f"no option {flag_name(name)}")
                raise UserError(f"{flag_name(name)} applies to --problem {' or '.join(owners)}")
            _convert(flag_name(name), names[name], value)
        if options:
            own = self.kind_options()
            _check_choices(own, {f.name: f.metadata["choices"] for f in fields(own) if f.metadata["choices"]})
            own.check()

    def _check_lora(self):
        given = [name for name in ("lora_targets", "merge_lora", "load_in_8bit", "load_in_4bit") if getattr(self, name)]
        if given and not self.lora:
            raise UserError(f"{flag_name(given[0])} needs --lora")
        if self.load_in_8bit and self.load_in_4bit:
            raise UserError("--load-in-8bit and --load-in-4bit: choose one")
        if not self.load_in_4bit and (self.use_bnb_nested_quant or self.bnb_4bit_quant_type != "nf4"):
            raise UserError(f"{'--use-bnb-nested-quant' if self.use_bnb_nested_quant else '--bnb-4bit-quant-type'} "
                            "needs --load-in-4bit")
        if self.lora_r < 1:
            raise UserError(f"--lora-r must be at least 1, not {self.lora_r}")

    def _check_observers(self):
        if self.profile_steps:
            from .observe.profile import parse_steps

            parse_steps(self.profile_steps)
            if not self.output_dir:
                raise UserError("--profile-steps needs an --output-dir, where profile/ is written")
        unknown = [name for name in trackers(self.report_to) if name not in TRACKERS]
        if unknown:
            raise UserError(f"--report-to takes {', '.join(TRACKERS)} or none, comma-separated; not {unknown[0]!r}")


@dataclass
class PredictOptions:
    """`xla-train predict`: a fine-tuned classifier's predictions, or a causal LM's completions,
    for a file."""

    model: str = option(None, "a folder written by xla-train train (or any fine-tuned sequence-classification "
                        "or causal-LM folder; a --lora run's adapter folder too)", required=True)
    input: str = option(None, ".csv, .tsv, .json, .jsonl, or a GLUE .tsv file (test.tsv); for a causal LM, rows "
                        "with a 'prompt' column or a 'messages' column (chat turns)", required=True)
    output: str = option(None, "file to write (missing folders are made): GLUE's index<TAB>prediction for a GLUE "
                         "file, else the input's columns plus prediction and score (a causal LM: plus "
                         "completion), in the format of its extension", required=True)
    backend: str = backend_option()
    strategy: str = strategy_option()
    num_processes: int = option(None, "workers on this host (default: one per TPU core or GPU; 1 on the CPU)")
    batch_size: int = option(8, "rows per replica and batch")
    text_columns: str = option(None, "A or A,B (default: the columns the model was trained on)")
    task: str = option(None, "the GLUE task whose file layout --input has (default: the model's own task)")
    max_length: int = option(None, "truncate rows; a causal LM's prompts keep their last tokens (default: training's, "
                             "else 128)")
    buckets: str = option("auto", "auto, or lengths like 32,64,96,128")
    # a causal LM's generation
    max_new_tokens: int = option(None, "causal LM: tokens to generate per row at most; a row ends at its "
                                 "end-of-sequence token (default: 64)")
    temperature: float = option(None, "causal LM: 0 picks the likeliest token (greedy, the default); above 0 "
                                "samples from the logits divided by it")
    top_p: float = option(None, "causal LM, with --temperature above 0: sample from the likeliest tokens whose "
                          "probability reaches this share, in (0, 1] (default: 1, all)")
    seed: int = option(None, "causal LM: the sampling's random seed (default: 0)")
    metrics_out: str = option(None, "write the rows, the time taken (a causal LM: tokens generated and tokens/s) "
                              "and, on XLA, the compilations as JSON here")

    def validate(self):
        from .core.select import BACKENDS

        _check_choices(self, {"backend": BACKENDS})
        _at_least_one(self, ("batch_size",), ("max_length", "max_new_tokens"))
        _check_numbers(self, {
            "temperature": (lambda x: x >= 0, "a number >= 0"),
            "top_p": (lambda x: 0 < x <= 1, "in (0, 1]"),
        })
        if self.top_p is not None and not self.temperature:
            raise UserError("--top-p applies to sampling: give --temperature above 0 too")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise UserError(f"--seed must be in [0, 2**32), not {self.seed}")
        if self.metrics_out:
            check_output_file(self.metrics_out, "--metrics-out")
        check_choices(self.task)
        check_output_file(self.output, "--output", formats=FILE_FORMATS)
        check_model_path(self.model, need=True)
        if self.max_length:
            parse_buckets(self.buckets, self.max_length)


def _check_choices(opts, choices):
    for name, allowed in choices.items():
        check_choice(flag_name(name), getattr(opts, name), allowed)


def _at_least_one(opts, always, when_given):
    for name in (*always, *(n for n in when_given if getattr(opts, n) is not None)):
        if getattr(opts, name) < 1:
            raise UserError(f"{flag_name(name)} must be at least 1")


def _check_numbers(opts, rules):
    for name, (ok, what) in rules.items():
        check_number(flag_name(name), getattr(opts, name), ok, what)


def check_model_path(name, need=False):
    """A --model that names a local path (or, with `need`, any --model) must be a model folder;
    anything else is a hub name."""
    path = Path(name).expanduser()
    if not (need or path.exists() or str(name).startswith(("/", ".", "~"))):
        return
    if not path.exists():
        raise UserError(f"--model {name}: no such folder")
    if not (path / "config.json").is_file():
        raise UserError(f"--model {name}: not a model folder (no config.json in it)")


def check_output_file(name, option, formats=None):
    """A file the run writes at its end can be written: no folder, of a known format (`formats`),
    under a folder or a path where one can be made (missing folders are made when it is written)."""
    from .io.storage import nearest_existing

    path = Path(name)
    if formats and path.suffix.lower() not in formats:
        raise UserError(f"{option} {path}: unknown file type {path.suffix or '(none)'!r}; use {', '.join(formats)}")
    if path.is_dir():
        raise UserError(f"{option} {name} is a folder; name a file")
    parent = nearest_existing(path.parent)
    if not parent.is_dir():
        raise UserError(f"{option} {name}: {parent} is a file, not a folder")


def option_fields(cls):
    """(flag, field) of every option of `cls`, in declaration order (TrainOptions: the shared ones)."""
    return [(flag_name(f.name), f) for f in fields(cls) if f.metadata.get("section") != OWN]


def kind_option_fields() -> dict[str, list[tuple[str, Field]]]:
    """{name: [(kind, field), ...]} of every kind's own options: a name may be several kinds' (TRL's
    `beta` is DPO's and GRPO's), one flag for all of them."""
    out: dict[str, list[tuple[str, Field]]] = {}
    for kind, cls in KINDS.items():
        for f in fields(cls.Options) if cls.Options else ():
            out.setdefault(f.name, []).append((kind, f))
    return out


# --- sections and recipes ------------------------------------------------------------------------
# A recipe is a YAML file of training's options by section:
#     optimizer:
#       lr: 2.0e-4
#       epochs: 1
# or flat (`lr: 2.0e-4` at the top level, as TRL's config files are). Names are the fields' (dashes
# accepted too); a flag given on the command line overrides the
# recipe (cli.py). These say what a command does with the output folder, not what the job is: a
# recorded recipe holds them at their defaults, so that it reruns the job.
RUN_CONTROL = ("resume", "overwrite", "resume_from")
# Options that are comma-separated lists: a recipe may give them as YAML lists.
COMMA_LISTS = ("buckets", "text_columns", "lora_targets", "report_to")
_KINDS: dict[Any, type] = {"str": str, "int": int, "float": float, "bool": bool}
_WORDS: dict[type, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


class Section(Mapping[str, Any]):
    """One section of the options, read-only, by key or attribute: a consumer's whole view of them."""

    def __init__(self, name: str, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_values", MappingProxyType(dict(values)))

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):  # not an option (copy and pickle look for such names before __init__)
            raise AttributeError(key)
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"the {self._name} section has no option {key!r}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise TypeError("a section of the options is read-only")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Section({self._name!r}, {dict(self._values)!r})"

    def __reduce__(self) -> tuple:
        return Section, (self._name, dict(self._values))


def section_names(cls: type = TrainOptions) -> dict[str, list[str]]:
    """{section: its options' names, in declaration order}, every section of SECTIONS."""
    out: dict[str, list[str]] = {name: [] for name in SECTIONS}
    for _, f in option_fields(cls):
        out[f.metadata["section"]].append(f.name)
    return out


def section_of(name: str) -> str:
    """The section that holds training's option `name`."""
    return _FIELDS[name].metadata["section"]


def _section(name: str) -> str:
    if name not in SECTIONS:
        raise KeyError(f"no section {name!r}; the sections are {', '.join(SECTIONS)}")
    return name


def sections(cfg: TrainOptions) -> dict[str, dict[str, Any]]:
    """{section: {option: value}}: every option of `cfg`, by section (SECTIONS' order), then the
    chosen kind's own in the section named after it (where the kind has any)."""
    out = {name: {key: getattr(cfg, key) for key in keys} for name, keys in section_names(type(cfg)).items()}
    own = cfg.kind_options()
    return {**out, cfg.problem: asdict(own)} if own is not None else out


def from_sections(recipe: Mapping[str, Mapping[str, Any] | None], where: str = "recipe") -> TrainOptions:
    """The reverse of `sections`: TrainOptions from {section: {option: value}} (options left out
    keep their defaults); unknown names and wrong types are a UserError naming `where`."""
    return TrainOptions(**recipe_values(recipe, where))


def recipe_values(recipe: Mapping[str, Any], where: str = "recipe") -> dict[str, Any]:
    """The options a recipe sets, flat ({name: value}), each checked: its name, its section where
    it is under one, and its type (the CLI's conversions: 8 or "8" for an int, 5e-5 or "5e-5" for a
    float). A recipe holds options by section, or flat at its top level as TRL's config files do
    (`learning_rate`'s counterpart `lr: 2.0e-5`): every option's name is unique, so its section is
    known. Both may be mixed; an option given twice is refused."""
    names = section_names()
    owner = {key: name for name, keys in names.items() for key in keys}
    kinds = kind_option_fields()
    values: dict[str, Any] = {}
    own: dict[str, Any] = {}

    def take(section: str, given: Any, value: Any, kind: str | None = None) -> None:
        key = str(given).replace("-", "_")
        if key in values or any(k.rpartition(".")[2] == key for k in own):
            raise UserError(f"{where}: {section}.{key} is given twice")
        if key in owner:
            values[key] = _convert(f"{where}: {section}.{key}", _FIELDS[key], value)
            return
        fields_of = dict(kinds[key])  # a kind's own option: checked for the kind chosen (TrainOptions._check_own)
        field_ = fields_of.get(kind or "") or next(iter(fields_of.values()))
        own[f"{kind}.{key}" if kind else key] = _convert(f"{where}: {section}.{key}", field_, value)

    for name, body in recipe.items():
        name = str(name)
        key = name.replace("-", "_")
        if name in KINDS and isinstance(body, Mapping | None):  # a kind's own section
            mine = [k for k, pairs in kinds.items() if any(kind == name for kind, _ in pairs)]
            for given, value in (body or {}).items():
                if str(given).replace("-", "_") not in mine:
                    raise UserError(f"{where}: no option '{name}.{given}'"
                                    f"{_did_you_mean(str(given), mine)}; the {name} section has: "
                                    f"{', '.join(mine) or 'nothing'}")
                take(name, given, value, name)
            continue
        if name not in SECTIONS or (key in owner and body is not None and not isinstance(body, Mapping)):
            # flat (`model` is a section and an option: a string under it is the option)
            if key not in owner and key not in kinds:
                raise UserError(f"{where}: no section or option {name!r}"
                                f"{_did_you_mean(key, [*SECTIONS, *owner, *kinds])}; a recipe's sections are: "
                                f"{', '.join([*SECTIONS, *(k for k in KINDS if KINDS[k].Options)])}")
            take(owner.get(key) or "/".join(k for k, _ in kinds[key]), name, body)  # flat: the option at the top level
            continue
        if body is None:  # `optimizer:` with nothing under it
            continue
        if not isinstance(body, Mapping):
            raise UserError(f"{where}: section {name} must hold 'option: value' lines, not {body!r}")
        for given, value in body.items():
            key = str(given).replace("-", "_")
            if key not in names[name]:
                if key in owner:
                    raise UserError(f"{where}: no option '{name}.{given}'; {key} is in the {owner[key]} section")
                if key in kinds:
                    raise UserError(f"{where}: no option '{name}.{given}'; {key} is in the "
                                    f"{' or '.join(k for k, _ in kinds[key])} section")
                raise UserError(f"{where}: no option '{name}.{given}'{_did_you_mean(key, names[name])}; the {name} "
                                f"section has: {', '.join(names[name])}")
            take(name, given, value)
    return {**values, "own": own} if own else values


def _did_you_mean(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kind(f: Field) -> type:
    return _KINDS[f.type] if isinstance(f.type, str) else f.type


def _takes_a_list(f: Field) -> bool:
    """A comma-separated option (or a kind's repeatable one), which a recipe may give as a YAML list."""
    return f.name in COMMA_LISTS or bool(f.metadata.get("repeat"))


def _convert(what: str, f: Field, value: Any) -> Any:
    """A recipe's value of option `f`, as the command line would have it, or one line saying what
    it must be."""
    kind = _kind(f)
    if value is None:
        if f.default is None:
            return None
        raise UserError(f"{what} must be {_WORDS[kind]}, not null (leave it out for its default, {f.default})")
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif isinstance(value, bool):
        pass  # true where a number or a string goes
    elif kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value):
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str):
        return value
    elif isinstance(value, (int, float)):
        return str(value)
    elif _takes_a_list(f) and isinstance(value, list) and value and \
            all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        return ",".join(map(str, value))
    words = _WORDS[kind] + (" or a list" if _takes_a_list(f) else "")
    shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as YAML writes it
    raise UserError(f"{what} must be {words}, not {shown}")


def parse_recipe(text: str, where: str = "recipe") -> dict[str, Any]:
    """A recipe's YAML text as {section: {option: value}}, unchecked; a file that is not YAML, or
    not a mapping, is a UserError naming `where` (and the line)."""
    yaml, loader, _ = _yaml()
    try:
        data = yaml.load(text, Loader=loader)  # a SafeLoader (yaml.safe_load's), YAML 1.2's numbers
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{where}{line}: not a YAML recipe ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: a recipe is a mapping of sections ({', '.join(SECTIONS)}), not "
                        f"{type(data).__name__} {data!r}"[:300])
    return data


def read_recipe(path: str) -> dict[str, Any]:
    """The options recipe file `path` sets ({name: value}, checked); gs://bucket/file too."""
    where = str(path)
    text = None
    if where.startswith("gs://"):
        from .io.storage import open_store

        folder, _, name = where.rpartition("/")
        try:
            text = open_store(folder).read_text(name)
        except ImportError:
            raise UserError(f"--config {where}: reading Cloud Storage needs google-cloud-storage (pip install "
                            "'xla-train[gcs]')") from None
    else:
        file = Path(where).expanduser()
        if file.is_dir():
            raise UserError(f"--config {where} is a folder; name a YAML recipe")
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            pass
        except UnicodeDecodeError:
            raise UserError(f"--config {where}: not a text file (UTF-8)") from None
        except OSError as e:
            raise UserError(f"--config {where}: cannot be read ({e.strerror})") from None
    if text is None:
        raise UserError(f"--config {where}: no such file")
    return recipe_values(parse_recipe(text, where), where)


def recipe_sections(cfg: TrainOptions) -> dict[str, dict[str, Any]]:
    """`sections(cfg)` as a recorded recipe holds it: the bundled model as null (its path differs
    from one environment to the next), RUN_CONTROL at the defaults."""
    out = sections(cfg)
    if cfg.model == bundled_model_path():
        out["model"]["model"] = None
    for name in RUN_CONTROL:
        out[section_of(name)][name] = _FIELDS[name].default
    return out


def non_defaults(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{section: {option: value}} of the options in `values` (flat) that differ from the defaults;
    the bundled model is a default."""
    defaults = {key: v for section in recipe_sections(TrainOptions()).values() for key, v in section.items()}
    out: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        if key in defaults and value != defaults[key] and not (key == "model" and value == bundled_model_path()):
            out.setdefault(section_of(key), {})[key] = value
    for key, value in values.get("own", {}).items():  # a kind's own options, as given
        kind, _, name = key.rpartition(".")
        out.setdefault(kind or str(values.get("problem") or "own"), {})[name] = value
    return {name: out[name] for name in [*SECTIONS, *out] if name in out}


def recipe_text(cfg: TrainOptions, header: tuple[str, ...] | list[str] = ()) -> str:
    """`cfg` as a YAML recipe: every option, defaults included, by section (each headed by a
    comment), after `header`'s lines as comments. `read_recipe` reads it back to `cfg` (but for
    RUN_CONTROL)."""
    yaml, _, dumper = _yaml()
    lines = [f"# {line}".rstrip() for line in header]
    for name, values in recipe_sections(cfg).items():
        text = yaml.dump({name: values}, Dumper=dumper, sort_keys=False, default_flow_style=False, width=4096,
                         allow_unicode=True)
        if name == "model" and values["model"] is None:
            text = text.replace("\n  model: null\n", f"\n  model: null  # {BUNDLED_MODEL}\n", 1)
        about = SECTIONS.get(name) or f"{name}'s own options"
        lines += ["", f"# {about}", text.rstrip("\n")]
    return "\n".join(lines).lstrip("\n") + "\n"


_YAML: tuple[Any, Any, Any] | None = None
_INT = r"^[-+]?[0-9]+$"
_FLOAT = (r"^[-+]?(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)$"
          r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")


def _yaml() -> tuple[Any, Any, Any]:
    """(yaml, loader, dumper): PyYAML's safe loader and dumper (imported here: `--help` starts
    without it), numbers read as YAML 1.2 reads them: 5e-5 is a float (YAML 1.1: a string),
    12:16 a string (YAML 1.1: 736), 012 is 12."""
    global _YAML
    if _YAML is None:
        import yaml

        int_tag, float_tag = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"

        def numbers(cls):
            cls.yaml_implicit_resolvers = {c: [(t, rx) for t, rx in rs if t not in (int_tag, float_tag)]
                                           for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
            cls.add_implicit_resolver(int_tag, re.compile(_INT), list("-+0123456789"))
            cls.add_implicit_resolver(float_tag, re.compile(_FLOAT), list("-+0123456789."))
            return cls

        def to_float(loader, node):
            return float(loader.construct_scalar(node).replace(".inf", "inf").replace(".Inf", "inf")
                         .replace(".INF", "inf").replace(".nan", "nan").replace(".NaN", "nan").replace(".NAN", "nan"))

        loader = numbers(type("RecipeLoader", (yaml.SafeLoader,), {}))
        loader.add_constructor(int_tag, lambda loader, node: int(loader.construct_scalar(node)))
        loader.add_constructor(float_tag, to_float)
        dumper = numbers(type("RecipeDumper", (yaml.SafeDumper,), {}))
        _YAML = (yaml, loader, dumper)
    return _YAML


_FIELDS: dict[str, Field] = {f.name: f for _, f in option_fields(TrainOptions)}
_unplaced = [name for name, f in _FIELDS.items() if f.metadata["section"] not in SECTIONS]
if _unplaced:  # declared once: a new option names its section
    raise TypeError(f"TrainOptions fields without a section: {', '.join(_unplaced)}")
