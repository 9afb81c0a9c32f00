"""The model-family matrix: every decoder of the zoo (tiny_decoders.ZOO: tiny models with the
flags of Llama-3.2-1B, Qwen2.5-0.5B-Instruct, gemma-2b, gemma-2-2b, Mistral-7B-v0.1 and gpt2, and
of the late-2026 families, tiny_decoders.LATE_2026, on the CPU and in one XLA cell: LATE_XLA_CELL)
x {fp32, bf16} x {full, LoRA} x {CPU, XLA:CPU} (XLA's fp32 cells for two families: FP32_XLA_FAMILIES)
trains, evaluates, saves and reloads, and generates,
in pytest's own process through the package's own functions (what `xla-train train` and
`xla-train predict` call): Engine, the causal-LM task, checkpoint.save and Resume,
Engine.save_pretrained and load_trained, tasks/completion.py's prompts and kernels/generate.py's loop.

Each cell (`run_cell`):
  train     3 epochs of 4 steps (16 documents, batch 4, the family's chat rows where it has a chat
            template, else prompt/completion rows; two length buckets), the loop's own step
            (the objective's forward and loss under engine.autocast, backward, optimizer_step, the linear
            schedule): every loss finite, and the loss of the last epoch below the first's
  evaluate  after every epoch (evaluate_model): the loss finite, every validation document once
  save      a checkpoint (checkpoint.save) and the model folder (Engine.save_pretrained)
  reload    the checkpoint as a resumed run loads it (Resume: weights, optimizer, scheduler) and
            the folder as predict loads it (load_trained): tied embeddings still one tensor, and
            each reloaded model computes the trained model's per-row losses and its logits of a
            batch bit for bit, on the same device
  generate  as `xla-train predict` does (a fresh fp32 Engine, read_prompts, an adapter merged,
            left padding, generate_rows): max_new_tokens columns of ids inside the vocabulary,
            padding after a row's first end-of-sequence token
  XLA       (XLA:CPU cells) training and evaluation compile at most two graphs per bucket and two
            more, none after the first epoch; no aten fallback in the whole cell; at most 0.1 host
            syncs per training step; a reloaded model evaluates without compiling; generation
            compiles at most two graphs per bucket and one more, and copies to the host once.

torch_xla's counters are the process's: each XLA cell clears them first (met.clear_all()). XLA
runs in this process on PJRT's CPU device, its runtime started after collection and compiling
at LLVM's -O0 (conftest.start_xla_in_process): the same graphs and counts, compiled in about a
third of the time. The XLA cells are marked `slow` (left out of make test-fast) and `xla`
(skipped by make test-torch, which has no torch_xla).

Cells that fail on current code are marked xfail(strict=True) in KNOWN, with the error they
raise: fixing the bug makes them pass, which strict xfail reports as a failure, so the mark is
removed with the fix. None fails at 90386d7; what failed before it (at 71d810f, 23 cells) is in
docs/tests.md.
"""

from types import SimpleNamespace

import pytest
import tiny_decoders as td
import torch

PRECISIONS = ("fp32", "bf16")
MODES = ("full", "lora")
DEVICES = ("cpu", "xla")
EPOCHS, BATCH, TRAIN_DOCS, EVAL_DOCS, MAX_LENGTH, MAX_NEW_TOKENS = 3, 4, 16, 6, 32, 6
LR = 1e-2
LORA = SimpleNamespace(lora_targets=None, lora_r=8, lora_alpha=16, lora_dropout=0.0)  # peft's default targets

# The late-2026 families (tiny_decoders.LATE_2026) run every CPU cell and one XLA cell: bf16 full
# fine-tuning, what a TPU user runs first. Run together in one process, their 36 XLA cells crashed
# torch_xla (a segmentation fault in torch_xla.sync, after 26 or 28 cells, in a bf16 cell of
# Qwen3-MoE or Mixtral, 2026-11-28); each family's four cells alone, and the three expert families'
# twelve together, pass.
LATE_XLA_CELL = ("bf16", "full")
# XLA in fp32 for two families of the zoo (Llama's RoPE and GQA; GPT-2's learned positions, Conv1D
# and biases), both modes; every family runs XLA's bf16 cells (what a TPU user runs), and every
# fp32 cell on the CPU. An fp32 XLA cell compiles the bf16 cell's graphs without autocast's casts:
# the other four families' took about 70 s of make test's CPU time (2026-12-01), for no path of
# their own.
FP32_XLA_FAMILIES = ("llama", "gpt2")

# Cells that fail on current code: {(family, device, precision, mode): (exception, reason)}
KNOWN = {
    ("phi4mini", "xla", "bf16", "full"): (
        AssertionError, "LongRoPE (transformers 5.24 modeling_rope_utils.longrope_frequency_update) makes its "
        "long_inv_freq on the device at a model's first forward pass, inside that graph, so a reloaded model's "
        "first evaluation compiles a graph of its own (one more compilation per fresh model and shape)"),
}


def _cells():
    for family in (*td.FAMILIES, *td.LATE_2026):
        for device in DEVICES:
            for precision in PRECISIONS:
                for mode in MODES:
                    if family in td.LATE_2026 and device == "xla" and (precision, mode) != LATE_XLA_CELL:
                        continue  # see LATE_XLA_CELL
                    if device == "xla" and precision == "fp32" and family not in FP32_XLA_FAMILIES:
                        continue  # see FP32_XLA_FAMILIES
                    # XLA cells: torch_xla needed (skipped without it), its runtime started in this
                    # process after collection (conftest.start_xla_in_process), left out of make test-fast
                    marks = [pytest.mark.xla, pytest.mark.xla_in_process, pytest.mark.slow] if device == "xla" else []
                    known = KNOWN.get((family, device, precision, mode))
                    if known:
                        marks.append(pytest.mark.xfail(strict=True, raises=known[0], reason=known[1]))
                    yield pytest.param(family, device, precision, mode, marks=marks,
                                       id=f"{family}-{device}-{precision}-{mode}")


# ---------------------------------------------------------------------------------------------
# The zoo, saved once


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """{family: SimpleNamespace}: the family saved with its own tokenizer (tiny_decoders.save,
    own_tokens), its rows (chat turns where the tokenizer has a chat template), their tokenised
    splits and two length buckets, and prompts to complete; each made when a cell first needs it."""
    class Zoo(dict):
        def __missing__(self, family):  # each family once, when a cell first asks for it
            self[family] = _family(family, tmp_path_factory.mktemp(family))
            return self[family]

    return Zoo()


def _family(family, folder):
    from xla_train.core.shapes import padding_for
    from xla_train.models import load_tokenizer
    from xla_train.tasks import Source, load_task

    path = td.save(family, folder / "model", own_tokens=True)
    tok = load_tokenizer(str(path))  # what the job loads: the end-of-sequence token pads where none does
    form = "messages" if tok.chat_template else "prompt/completion"
    train = td.write_jsonl(folder / "train.jsonl", td.reverse_rows(TRAIN_DOCS, 1, form))
    validation = td.write_jsonl(folder / "validation.jsonl", td.reverse_rows(EVAL_DOCS, 2, form))
    prompts = [{"prompt": r["prompt"]} if form == "prompt/completion" else {"messages": r["messages"][:1]}
               for r in td.reverse_rows(5, 3, form)]
    # one document a row, in length buckets: the bucket bound is the one under test
    task, splits = load_task(Source(train_file=str(train), validation_file=str(validation), problem="causal-lm",
                                    max_length=MAX_LENGTH, packing=False))
    data, _ = task.rows.tokenize(splits, tok, MAX_LENGTH)
    lengths = sorted(data["train"]["length"])
    padding = padding_for("buckets", sorted({lengths[len(lengths) // 2], lengths[-1]}), MAX_LENGTH,
                          [split["length"] for split in data.values()])
    assert len(padding.buckets) == 2, lengths  # 3- to 5-letter lists: rows of several lengths
    return SimpleNamespace(path=path, tok=tok, form=form, task=task, data=data, padding=padding,
                           prompts=td.write_jsonl(folder / "prompts.jsonl", prompts))


# ---------------------------------------------------------------------------------------------
# One cell


def fresh_model(z, mode, precision, resume=None):
    """The model as the job prepares it (job.prepare): the pretrained decoder in fp32 without a
    cache, LoRA adapters added, a resumed checkpoint's weights loaded, and with LoRA in bf16 the
    frozen base held in bf16."""
    from xla_train.models import add_adapters, hold_frozen_in_bf16

    model = z.task.model.load(str(z.path), seed=0)
    if mode == "lora":
        model = add_adapters(model, LORA, z.task.model.peft_task_type)
    if resume is not None:
        resume.load_model(model, resume.model_weights())
    if mode == "lora" and precision == "bf16":
        hold_frozen_in_bf16(model)
    return model


def assert_tied(model, where):
    """Where the config ties the embeddings, the output projection is the input embedding itself."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.config.tie_word_embeddings:
        out, inp = base.get_output_embeddings().weight, base.get_input_embeddings().weight
        # XLA tensors have no storage (data_ptr() is 0 for every one): there only the object counts
        shared = out is inp or (out.device.type == "cpu" and out.data_ptr() == inp.data_ptr())
        assert shared, f"{where}: the output projection and the input embedding are two tensors"


class Counters:
    """torch_xla's process-wide counters (compilations, device-to-host transfers, aten fallbacks),
    read through the Engine; None on the CPU."""

    def __init__(self, engine):
        self.engine = engine
        if engine.runtime == "xla":
            import torch_xla.debug.metrics as met

            met.clear_all()

    def __call__(self):
        return self.engine.compile_stats()


def run_cell(z, device, precision, mode, out):
    from xla_train.commands.train import linear_schedule
    from xla_train.core.batching import make_loader, model_inputs_only
    from xla_train.core.engine import Engine
    from xla_train.core.inference import infer
    from xla_train.evaluation import evaluate_model
    from xla_train.io.storage import open_store
    from xla_train.run import checkpoint

    engine = Engine(device, precision=precision)
    engine.seed(0)
    counters = Counters(engine)
    xla = engine.runtime == "xla"
    task, tok = z.task, z.tok
    objective = task.objective
    model = fresh_model(z, mode, precision)
    data = model_inputs_only(z.data, model)

    def loader(split, train):
        return make_loader(data[split], tok, BATCH, z.padding, shuffle=train, seed=0,
                           fill="repeat" if train else "mask", collate=task.rows.collator(tok))

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=engine.fused_optimizer or None)  # as Trainer.setup
    train_dl, eval_dl, model, optimizer = engine.prepare(loader("train", True), loader("validation", False), model,
                                                         optimizer)
    steps = EPOCHS * len(train_dl)
    scheduler = linear_schedule(optimizer, 0, steps)
    assert_tied(model, "prepared")

    # --- train and evaluate (train.Trainer.train's step) ---------------------------------------------
    losses, evaluations, syncs = [], [], 0
    for epoch in range(EPOCHS):
        train_dl.set_epoch(epoch)
        model.train()
        before = counters()
        for batch in train_dl:
            labels = batch.pop("labels")
            with engine.autocast():
                loss = objective.loss(objective.forward(model, batch), labels)
            engine.backward(loss)
            assert engine.optimizer_step(optimizer)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach().float())
        if xla:
            syncs += counters()["transfers"] - before["transfers"]  # the steps' own, evaluations left out
        evaluations.append(evaluate_model(engine, model, eval_dl, objective, None))
        if epoch == 0:
            first_epoch = counters()
    trained = counters()
    engine.cut_graph()
    host = torch.stack(engine.strategy.read(losses))  # computed already: one transfer, no graph
    assert len(host) == steps == EPOCHS * TRAIN_DOCS // BATCH
    assert torch.isfinite(host).all(), host
    per_epoch = host.view(EPOCHS, -1).mean(1)
    assert per_epoch[-1] < per_epoch[0], host  # it learns
    for results in evaluations:
        assert torch.isfinite(torch.tensor(results["loss"])) and results["n"] == EVAL_DOCS, results
    assert evaluations[-1]["loss"] != evaluations[0]["loss"]
    if xla:
        buckets = len(z.padding.buckets)
        # training: a graph per bucket and the first step's (no optimizer state yet); evaluation:
        # a graph per bucket and the gathered rows'
        assert trained["compiles"] <= 2 * buckets + 2, trained
        assert trained["compiles"] == first_epoch["compiles"], (first_epoch, trained)  # none after the first epoch
        assert (syncs + 1) / steps <= 0.1, (syncs, steps)  # the loop never waits for the device

    # --- what a reloaded model must compute: the trained model's per-row losses and logits ----------
    batch = next(iter(eval_dl))  # one evaluation batch, on the device

    def outputs(m):
        """Per-row losses through the evaluation's own loop (on XLA its graphs, compiled once
        already: none may compile) and the logits of one batch, on the host."""
        before = counters()
        columns = infer(engine, m, eval_dl, objective.eval_columns, forward=objective.forward)
        if xla:
            assert counters()["compiles"] == before["compiles"], (before, counters())
        m.eval()
        with engine.inference_mode(), engine.autocast():
            head = objective.forward(m, {k: v for k, v in batch.items() if k != "labels"})
            if hasattr(head, "logits"):  # a head outside lm_loss.PLAIN_HEADS (Granite's scaling): the model's own
                logits = head.logits.float()
            else:  # causal_lm.HeadInput: the head's logits, whole
                logits = (head.hidden.float() @ head.weight.float().T)
        (logits,) = engine.to_host([logits])
        return columns, logits

    reference = outputs(model)

    def assert_computes_the_trained_models(m, whose):
        columns, logits = outputs(m)
        for got, want in zip(columns, reference[0], strict=True):
            assert torch.equal(got, want), f"{whose} per-row losses differ from the trained model's: {got} {want}"
        assert torch.equal(logits, reference[1]), f"{whose} logits differ from the trained model's"

    # --- save a checkpoint, and resume from it as a run does (job.prepare, RunState) ----------------
    store = open_store(out / "run")
    state = {"run": {"step": steps, "epoch": EPOCHS, "batch": 0}, "world_size": engine.data_parallel_size,
             "n_train": len(data["train"]), "config": {"model": str(z.path)}}
    checkpoint.save(engine, store, model, optimizer, scheduler, state)
    resume = checkpoint.Resume(*checkpoint.find(store))
    resumed = fresh_model(z, mode, precision, resume)
    assert_tied(resumed, "resumed from the checkpoint")
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=LR, fused=engine.fused_optimizer or None)
    resumed, resumed_optimizer = engine.prepare(resumed, resumed_optimizer)
    resumed_scheduler = linear_schedule(resumed_optimizer, 0, steps)
    resume.load_training_state(engine, resumed, resumed_optimizer, resumed_scheduler, engine.data_parallel_size)
    assert resumed_scheduler.last_epoch == steps
    assert {int(s["step"]) for s in resumed_optimizer.state_dict()["state"].values()} == {steps}
    assert_tied(resumed, "resumed and prepared")
    assert_computes_the_trained_models(resumed, "the resumed model's")

    # --- the model folder, reloaded as predict loads it ------------------------------------------
    folder = out / "model"
    engine.save_pretrained(model, tok, folder)
    assert (folder / ("adapter_config.json" if mode == "lora" else "model.safetensors")).is_file()
    reloaded = task.model.load_trained(folder)
    assert_tied(reloaded, "reloaded from the model folder")
    held = {name: p.dtype for name, p in engine.unwrap_model(model).named_parameters()}
    for name, p in reloaded.named_parameters():  # as trained: with LoRA in bf16, the frozen base in bf16
        p.data = p.data.to(held[name])
    reloaded = engine.prepare(reloaded)
    assert_tied(reloaded, "reloaded and prepared")
    assert_computes_the_trained_models(reloaded, "the reloaded folder's")

    # --- generate, as xla-train predict does -------------------------------------------------------
    generate(z, device, folder, counters if xla else None)
    if xla:
        assert counters()["aten_fallbacks"] == 0, counters()


def generate(z, device, folder, counters):
    """`xla-train predict` on the folder: a fresh fp32 Engine, the prompts read and tokenised as
    predict reads them, the adapter merged, left padding, static shapes on XLA."""
    from xla_train.core.engine import Engine
    from xla_train.core.inference import predict_loader
    from xla_train.core.shapes import padding_for
    from xla_train.kernels.generate import Sampling, generate_rows
    from xla_train.tasks.completion import (
        check_lengths,
        completions,
        end_ids,
        generation_model,
        left_padded,
        read_prompts,
    )

    engine = Engine(device)
    engine.seed(0)
    model = generation_model(z.task.model.load_trained(folder))
    prompts = read_prompts(z.prompts, z.tok, MAX_LENGTH)
    columns, data = prompts.columns, prompts.data
    longest = max(data["length"])
    padding = padding_for("buckets", [longest], longest, [data["length"]])
    check_lengths(model, z.tok, longest, MAX_NEW_TOKENS)
    eos = end_ids(z.tok, model)
    tok = left_padded(z.tok, eos)
    sampling = Sampling(MAX_NEW_TOKENS, eos, tok.pad_token_id)
    loader = predict_loader(engine, tok, data, BATCH, padding)
    model = engine.prepare(model)
    before = counters() if counters else None
    tokens = generate_rows(engine, model, loader, sampling)
    assert tokens.shape == (len(columns["prompt" if "prompt" in columns else "messages"]), MAX_NEW_TOKENS)
    assert tokens.dtype == torch.long
    vocab = model.config.get_text_config().vocab_size
    assert ((tokens >= 0) & (tokens < vocab)).all(), tokens
    for row in tokens.tolist():  # the first end-of-sequence token, then padding only
        ends = [i for i, t in enumerate(row) if t in eos]
        if ends:
            assert all(t == sampling.pad_id for t in row[ends[0] + 1:]), row
    texts, counts = completions(tokens, z.tok, eos)
    assert all(isinstance(t, str) for t in texts) and all(1 <= c <= MAX_NEW_TOKENS for c in counts)
    if counters:
        after = counters()
        assert after["compiles"] - before["compiles"] <= 2 * len(padding.buckets) + 1, (before, after)
        assert after["transfers"] - before["transfers"] == 1, (before, after)  # the tokens, copied once


# ---------------------------------------------------------------------------------------------
# The matrix


@pytest.mark.parametrize("family, device, precision, mode", list(_cells()))
def test_cell(family, device, precision, mode, zoo, tmp_path):
    run_cell(zoo[family], device, precision, mode, tmp_path)


# ---------------------------------------------------------------------------------------------
# The zoo itself: the published flags, as transformers reads them from the saved folder

# What each published checkpoint has, restated here (tiny_decoders.ZOO is the data; these are the
# facts the matrix relies on): tied embeddings, query heads per key/value head (of the tiny model:
# 4 query heads), the padding token (None: none), the token that ends an assistant turn in its
# chat template (None: no template), and where the trained assistant turn opens with markup
# before the answer, that markup ("opens"). The late-2026 families (tiny_decoders.LATE_2026) are
# checked here and in the chat-template test, not in the matrix.
PUBLISHED = {
    "llama": dict(tied=True, heads_per_kv=4, pad=None, end_of_turn="<|eot_id|>"),
    "qwen2": dict(tied=True, heads_per_kv=2, pad="<|endoftext|>", end_of_turn="<|im_end|>"),
    "gemma": dict(tied=True, heads_per_kv=4, pad="<pad>", end_of_turn="<end_of_turn>"),
    "gemma2": dict(tied=True, heads_per_kv=2, pad="<pad>", end_of_turn="<end_of_turn>"),
    "mistral": dict(tied=False, heads_per_kv=4, pad=None, end_of_turn=None),
    "gpt2": dict(tied=True, heads_per_kv=1, pad=None, end_of_turn=None),
    # an empty thought opens the last assistant turn
    "qwen3": dict(tied=True, heads_per_kv=2, pad="<|endoftext|>", end_of_turn="<|im_end|>",
                  opens="<think>\n\n</think>\n\n"),
    "gemma3": dict(tied=True, heads_per_kv=4, pad="<pad>", end_of_turn="<end_of_turn>"),  # 4 over 1 published
    # /no_think's empty thought opens every assistant turn
    "smollm3": dict(tied=True, heads_per_kv=4, pad="<|finetune_right_pad_id|>", end_of_turn="<|im_end|>",
                    opens="<think>\n\n</think>\n"),
    "phi4mini": dict(tied=True, heads_per_kv=4, pad="<|endoftext|>", end_of_turn="<|end|>"),  # 3:1 published
    "olmo2": dict(tied=False, heads_per_kv=1, pad="<|pad|>", end_of_turn=None),  # multi-head attention
    "granite": dict(tied=True, heads_per_kv=4, pad="<|end_of_text|>", end_of_turn="<|end_of_text|>"),
    "qwen3moe": dict(tied=False, heads_per_kv=4, pad="<|endoftext|>", end_of_turn="<|im_end|>",  # 8:1 published
                     opens="<think>\n\n</think>\n\n"),
    "mixtral": dict(tied=False, heads_per_kv=4, pad=None, end_of_turn=None),
    # the answer in harmony's final channel, ended by <|return|>
    "gptoss": dict(tied=False, heads_per_kv=4, pad="<|endoftext|>", end_of_turn="<|return|>",  # 8:1 published
                   opens="<|channel|>final<|message|>"),
}


@pytest.mark.parametrize("family", [*td.FAMILIES, *td.LATE_2026])
def test_the_zoo_carries_the_published_flags(family, zoo):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    z, facts = zoo[family], PUBLISHED[family]
    assert set(PUBLISHED) == {*td.FAMILIES, *td.LATE_2026} and td.ZOO[family]["checkpoint"]
    model = AutoModelForCausalLM.from_pretrained(z.path)
    tok = AutoTokenizer.from_pretrained(z.path)  # as the job loads it (transformers picks Qwen2's own class)
    config = model.config
    assert config.model_type == td.ZOO[family]["config"]["model_type"]
    assert config.tie_word_embeddings is facts["tied"]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied is facts["tied"]
    heads = config.num_attention_heads if family != "gpt2" else config.n_head
    assert heads // getattr(config, "num_key_value_heads", heads) == facts["heads_per_kv"]
    assert tok.pad_token == facts["pad"]
    # the config names the padding token where the published config.json does (Gemma's), not Qwen2.5's
    assert config.pad_token_id == (tok.pad_token_id if "pad_token_id" in td.ZOO[family]["config"] else None)
    # the tokenizer's end-of-sequence token is the config's (the first of Gemma 3's two)
    eos = config.eos_token_id
    assert tok.eos_token_id == (eos[0] if isinstance(eos, list) else eos)
    # the tokenizer reloaded from the folder encodes as the one the zoo built
    text = "reverse a b c = c b a"
    assert tok(text)["input_ids"] == td.family_tokenizer(family)(text)["input_ids"]
    # the special tokens in the published order (a late family's published ids), and
    # generation_config.json's token ids those the zoo names
    spec = td.ZOO[family]["tokens"]
    published = spec.get("published_ids", {})
    assert sorted(published, key=published.get) == sorted(published, key=tok.convert_tokens_to_ids)
    generation = GenerationConfig.from_pretrained(z.path)
    for key, names in td.ZOO[family]["generation"].items():
        if key.endswith("token_id"):
            assert getattr(generation, key) == tok.convert_tokens_to_ids(names), key
    assert bool(tok.chat_template) is (spec["template"] is not None)
    attention = model.model.layers[0].self_attn if family != "gpt2" else None
    if family == "llama":
        rope = config.rope_parameters
        assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0 and rope["rope_theta"] == 500000.0
        assert rope["original_max_position_embeddings"] < config.max_position_embeddings
    if family == "qwen2":  # biases on q, k and v, none on o; more embedding rows than tokens
        assert attention.q_proj.bias is not None and attention.v_proj.bias is not None and attention.o_proj.bias is None
        assert config.vocab_size > len(tok) and not config.use_sliding_window
    if family == "gemma2":  # soft-capping, layers alternating a 4096-token window with global attention
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
        assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 4096
        assert config._attn_implementation == "eager"  # transformers' sdpa has no soft-capping
        assert config.head_dim * config.num_attention_heads != config.hidden_size
    if family == "mistral":
        assert config.sliding_window == 4096 and not tok.chat_template
    if family == "gpt2":
        assert config.embd_pdrop == config.attn_pdrop == config.resid_pdrop == 0.1
        assert tok.bos_token == tok.eos_token == "<|endoftext|>" and not tok.chat_template


@pytest.mark.parametrize("family", [f for f in (*td.FAMILIES, *td.LATE_2026) if PUBLISHED[f]["end_of_turn"]])
def test_the_chat_template_ends_the_assistant_turn_and_the_loss_trains_it(family, zoo):
    """Rendered by the family's template, the assistant's turn ends with its end-of-turn token,
    which the causal-LM task trains (with the newline after it, where the template puts one, or
    Phi-4-mini's end-of-sequence token), and opens with the markup the family's template puts
    before the answer (Qwen3's and SmolLM3's empty thought, gpt-oss's final channel), trained too."""
    from xla_train.tasks.causal_lm import chat

    z = zoo[family]
    messages = td.reverse_rows(1, 0, "messages")[0]["messages"]
    ids, trained = chat(messages, z.tok, "row 1")
    trained_ids = [i for i, t in zip(ids, trained) if t]
    trained_tokens = z.tok.convert_ids_to_tokens(trained_ids)
    end = PUBLISHED[family]["end_of_turn"]
    assert end in trained_tokens and trained_tokens.index(end) >= len(trained_tokens) - 2, trained_tokens
    opens = z.tok(PUBLISHED[family].get("opens", ""), add_special_tokens=False)["input_ids"]
    assert trained_ids[:len(opens)] == opens, trained_tokens
    answer = z.tok.decode(trained_ids[len(opens):], skip_special_tokens=True)
    assert answer.split() == messages[1]["content"].split()


@pytest.mark.parametrize("family", [f for f in (*td.FAMILIES, *td.LATE_2026) if PUBLISHED[f]["end_of_turn"]])
def test_every_assistant_turn_of_a_conversation_is_trained(family, zoo):
    """Two exchanges: both assistant answers are trained, each with its end of turn, and nothing
    of the user turns. Qwen3 (the empty thought on the last turn only), gpt-oss (<|return|> on the
    last turn, <|end|> before) and Phi-4-mini (end-of-sequence after the last turn) render an
    earlier turn otherwise once later turns follow it."""
    from xla_train.tasks.causal_lm import chat

    z = zoo[family]
    rows = td.reverse_rows(2, 1, "messages")
    messages = rows[0]["messages"] + rows[1]["messages"]
    ids, trained = chat(messages, z.tok, "row 1")
    runs = td.trained_runs(ids, trained)
    assert len(runs) == 2, [z.tok.decode(r) for r in runs]
    # gpt-oss ends an earlier turn with <|end|>, its last with <|return|>: any special token
    ends = {i for i, t in z.tok.added_tokens_decoder.items() if t.special}
    for turn, answer in zip(runs, (rows[0]["messages"][1]["content"], rows[1]["messages"][1]["content"])):
        assert ends & set(turn[-3:]), z.tok.convert_ids_to_tokens(turn)
        assert "".join(z.tok.decode(turn, skip_special_tokens=True).split()).endswith("".join(answer.split()))
