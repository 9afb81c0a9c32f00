"""Loading models and tokenizers, for training and prediction alike; LoRA adapters (peft): adding
them, merging them, loading an adapter folder."""

import contextlib
import io
import warnings

import torch

from .api import quiet_transformers
from .checkpoint import trained_state
from .errors import UserError, first_line
from .options import shown_model_name as shown_name


def load_pretrained(cls, name, **kwargs):
    """`cls.from_pretrained(name)` without transformers' progress bars and load report; a model
    that cannot be loaded (missing, unknown hub name offline, corrupt weights) is one line."""
    from safetensors import SafetensorError

    # OSError: missing files, an unknown or invalid hub name (huggingface_hub's errors, wrapped);
    # ValueError: no or unknown model_type, a broken tokenizer file (JSONDecodeError);
    # SafetensorError: damaged weights; RuntimeError: weights that do not fit their config.json
    try:
        with quiet_transformers():
            return cls.from_pretrained(name, **kwargs)
    except (OSError, ValueError, SafetensorError, RuntimeError) as e:
        raise UserError(f"cannot load model {name!r}: {first_line(e)}")


def position_limit(config, tokenizer):
    """The longest input the model takes: its position embeddings (RoBERTa's two offset ones not
    counted, as its tokenizer's model_max_length says), unbounded for relative positions only."""
    limits = [tokenizer.model_max_length] if tokenizer.model_max_length < 10**6 else []
    relative_only = config.model_type.startswith("deberta") and not getattr(config, "position_biased_input", True)
    if getattr(config, "max_position_embeddings", None) and not relative_only:
        limits.append(config.max_position_embeddings)
    return min(limits, default=10**9)


def load_tokenizer(name):
    from transformers import AutoTokenizer

    tokenizer = load_pretrained(AutoTokenizer, name)
    if tokenizer.pad_token is None:  # GPT-2, Llama and kin: pad with the end-of-sequence token, as users do
        if tokenizer.eos_token is None:
            raise UserError(f"the tokenizer of {name} has neither a padding nor an end-of-sequence token; save one "
                            "with a pad_token set")
        tokenizer.pad_token = tokenizer.eos_token
        print(f"tokenizer of {name}: no padding token; padding with its end-of-sequence token {tokenizer.eos_token!r}")
    return tokenizer


def load_model(name, seed, task, pad_token_id=None):
    """The pretrained encoder with a new head for the task (its label names in the config, so
    pipelines print them), initialised from `seed`."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    options = {"num_labels": task.num_labels, "problem_type": "regression" if task.problem == "regression" else None}
    if task.labels:
        options.update(id2label=dict(enumerate(task.labels)), label2id={n: i for i, n in enumerate(task.labels)})
    config = load_pretrained(AutoConfig, name)
    if config.pad_token_id is None and pad_token_id is not None:
        options["pad_token_id"] = pad_token_id  # decoder classifiers find each row's last token by it
    classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or ())
    if classifier and config.num_labels != task.num_labels:
        # a classifier fine-tuned for another label set: its head is replaced, as run_glue's
        # --ignore_mismatched_sizes does
        options["ignore_mismatched_sizes"] = True
    # transformers' load report would list the new head as a problem: say it here
    # fp32 weights whatever the checkpoint holds (transformers' dtype "auto" would keep a bf16
    # checkpoint's bf16, and AdamW would then update bf16 weights); --precision bf16 is autocast
    model, info = load_pretrained(AutoModelForSequenceClassification, name, output_loading_info=True,
                                  dtype=torch.float32, **options)
    _no_cache(model)
    new = sorted({*info["missing_keys"], *(k[0] if isinstance(k, tuple) else k for k in info["mismatched_keys"])})
    if new:
        print(f"model {shown_name(name)}: new classification head for {task.num_labels} output(s) ({', '.join(new)}), "
              f"initialised with --seed {seed}")
    return model


def _no_cache(model):
    """A classifier reads each row once: no key/value cache (a decoder builds one by default, and
    Mistral's sliding-window cache fails under XLA: "Value out of range ... got -4095")."""
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
    return model


ADAPTER_FILE = "adapter_config.json"  # what peft's save_pretrained writes beside the adapter's weights


def add_adapters(model, cfg):
    """`model` with LoRA adapters (peft) on `--lora-targets` (default: the attention projections
    peft knows for the architecture); only the adapters and the classification head train."""
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()] if cfg.lora_targets else None
    # SEQ_CLS: peft keeps the head ("classifier", "score") trainable in full (modules_to_save)
    config = LoraConfig(task_type="SEQ_CLS", r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=targets)
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # no default targets for the architecture, or targets it does not have
        raise UserError(f"--lora: {first_line(e)} (name them with --lora-targets)")


def hold_frozen_in_bf16(model):
    """--lora --precision bf16: the frozen base weights held in bf16, half their bytes (what lets
    a large decoder fit beside its activations); the adapters, the head and AdamW's state stay
    fp32. Autocast computes the base's matmuls in bf16 either way."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)


def save_merged(engine, model, load_base, tokenizer, folder):
    """--merge-lora: the trained tensors (adapters, head) copied to the CPU and merged (peft's
    merge, on the CPU) into a fresh copy of the adapted model from `load_base()`, whose base holds
    the model's own fp32 weights whatever the device held; saved as a whole fp32 model."""
    state = trained_state(engine.unwrap_model(model))
    weights = engine.to_writer(list(state.values()))

    def write():
        with contextlib.redirect_stdout(io.StringIO()):  # the new head's line was printed at the start
            cpu_model = load_base()
        unexpected = cpu_model.load_state_dict(dict(zip(state, weights)), strict=False).unexpected_keys
        assert not unexpected, unexpected  # the same architecture, adapted the same way
        with quiet_transformers():
            cpu_model.merge_and_unload().save_pretrained(folder)
            tokenizer.save_pretrained(folder)

    engine.on_main(write, f"cannot save the merged model to {folder}")


def load_classifier(folder):
    """A fine-tuned classifier for prediction: a whole model, or an adapter folder written by
    `--lora` (its base model from adapter_config.json, its head's config from config.json)."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForSequenceClassification

    if not (Path(folder) / ADAPTER_FILE).is_file():
        return _no_cache(load_pretrained(AutoModelForSequenceClassification, folder))
    from peft import PeftConfig, PeftModel

    base = PeftConfig.from_pretrained(folder).base_model_name_or_path
    config = load_pretrained(AutoConfig, folder)
    model = _no_cache(load_pretrained(AutoModelForSequenceClassification, base, config=config))
    try:
        with quiet_transformers(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return PeftModel.from_pretrained(model, folder)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"cannot load the adapter in {folder}: {first_line(e)}")
