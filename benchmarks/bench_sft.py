"""`--problem causal-lm` packed (`--packing`, the default) against bucket-padded (`--no-packing`,
`--buckets`) and against TRL's `SFTTrainer`, on the same model, data, steps, learning rate, batch
and max length, on the CPU and on XLA:CPU, all runs in this one command, one after the other.

    python benchmarks/bench_sft.py                         # 150 steps each, cpu and xla, packed, padded, trl
    python benchmarks/bench_sft.py --max-steps 20          # a quick check
    python benchmarks/bench_sft.py --backends cpu --modes packed,trl
    python benchmarks/bench_sft.py --backends cpu --same-documents
    python benchmarks/bench_sft.py --backends cpu --modes packed,trl --seeds 42,1,2,3,4
    python benchmarks/bench_sft.py --model DIR --train-file T.jsonl --validation-file V.jsonl --max-length 512
    python benchmarks/bench_sft.py --backends cuda --shape 1b --precision bf16   # a GPU: the 1B contest below

The default model and data are the tests' synthetic task (tests/tiny_decoders.py): a tiny random
Llama over the task's 17 words, 4,000 training rows reversing a list of letters, 64 validation
rows. Both modes run the same optimizer steps of the same number of rows, but a packed row holds
several documents, so packing trains on more documents (and trained tokens) per step: the table
shows both. With --same-documents the padded runs take as many more steps as a packed row holds
documents on average, so both see about the same documents. The validation loss is scored once,
at the last step.

TRL (`trl` mode; prompt/completion rows): `SFTConfig(packing=True, packing_strategy="bfd",
completion_only_loss=True)`, TRL's match for ours: whole documents packed best-fit decreasing into
rows of at most --max-length tokens, the loss on the completion and its end-of-sequence token
(TRL appends the tokenizer's EOS to a completion, as ours does). "bfd" turns TRL's padding-free
mode on: a batch's rows are concatenated into one sequence of 1 x (their tokens), with
`position_ids` restarting at 0 in every document, which transformers' sdpa mask
(`masking_utils.find_packed_sequence_indices`) turns into per-document attention, as our
segments do; there is no padding, and the shape changes from batch to batch. The rest is set to
what ours does: fp32 (TRL's default is bf16), no gradient checkpointing (TRL's default is on), no
gradient clipping (max_grad_norm 0; ours clips only with --max-grad-norm), AdamW without weight
decay, the linear schedule with int(warmup_ratio x steps) warm-up steps, the seed of ours, no
checkpoints, and it saves the final model as ours does. TRL's other defaults stay (its per-step
entropy and token-accuracy metrics, the loss logged every 10 steps). On the CPU TRL runs with
`USE_TORCH_XLA=0`, and on XLA:CPU with `PJRT_DEVICE=CPU` (transformers' Trainer then trains on
the XLA device); there, transformers' default optimizer (fused AdamW) raises, so the bench
records that exception for `xla-trl-default` and runs `xla-trl` with `optim="adamw_torch"` (ours
is unfused on XLA too). `xla-trl` compiles a graph for every new batch length; `xla-trl-static`
adds TRL's `pad_to_multiple_of=batch x --max-length` (the option TRL sets for Neuron, which also
compiles per shape), so every batch is one 1 x (batch x --max-length) sequence. The bench checks
that TRL's packed training documents are token for token ours (sorted; its unshifted labels against
our shifted ones) and records it as `same_documents`.

One seed's validation loss is no comparison: on the default task the loss after 150 steps depends
on the order of the batches far more than on the trainer (the drop from ~1.5 to ~0.2 comes
earlier or later). The seed sets that order (ours: `--seed`; TRL: `SFTConfig.seed`, its sampler),
and with seed 42 alone TRL scored 0.125 and ours 0.785; ours' seeds 1 to 8 gave 0.16 to 0.99 and
TRL's 0.08 to 0.66. Checked by hand: a plain torch loop (AdamW, transformers' linear schedule) on
ours' packed rows and collator reproduces ours' losses to 4 digits and on TRL's dataloader
TRL's; TRL's packed rows through ours' loader, collator and forward (seed 42) end at 0.117. So
`--seeds` trains the packed and trl cases once per seed (same steps, lr, batch), and the tables
give the eval loss's mean, min and max over the seeds beside the first seed's figures; compare
the means. Over 20 seeds (42, 1 to 19; 2026-11-26) the means were 0.518 (ours) and 0.409 (TRL)
at 150 steps (rank-sum p 0.29), and 0.0209 and 0.0161 with `--max-steps 306` (3 epochs; p 0.40):
equal within what 20 seeds resolve, with lagging seeds in both trainers (RESULTS.md).

The `eval loss` column is one function of the bench for every case: the saved model on the CPU in
fp32, each validation document alone (tokenised as the package tokenises it), the cross-entropy
summed over the trained tokens and divided by their number: our metrics' token-weighted loss.
`own eval loss` is each trainer's own figure: ours from the metrics JSON, TRL's
`trainer.evaluate()` on the same rows (a mean over its batches' means).

On a GPU (`--backends cuda`; `--shape 1b`: a Llama-3.2-1B-shaped model, hidden 2048, 16 layers, 32
heads, 8 key/value heads, intermediate 8192, tied embeddings, rope theta 500,000, random weights, the
bundled 30,522-token WordPiece vocabulary; prompt/completion rows of MRPC sentences, 100 to 1,250
tokens; defaults --max-length 2048, --batch-size 8, --lr 1e-4, --max-steps 40) one invocation runs
the package packed, eager and `--compile`, each with and without `--gradient-checkpointing`
(`cuda-packed`, `cuda-packed-compile`, `cuda-packed-gc`, `cuda-packed-compile-gc`), and TRL's
SFTTrainer three times: `cuda-trl-defaults` (the packing, data, steps and lr above, everything else
TRL's defaults: gradient checkpointing on, the model's sdpa attention), and at equal settings
`cuda-trl` (checkpointing off) and `cuda-trl-gc` (on), both with FlashAttention 2 where flash-attn
is installed, else `attn_implementation="flex_attention"` (TRL keeps packed documents apart without
a dense mask only through those). --precision bf16 is bf16 autocast on both sides (ours
`--precision bf16`, TRL's `bf16=True`, fp32 weights). The GPU table gives tokens/s (all steps),
steady tokens/s (ours: after the last compilation; TRL: after the first quarter of the steps),
MFU = 6 x parameters x tokens/s over the card's dense bf16 peak (by torch.cuda.get_device_name:
H100 and H200 989e12, A100 312e12; fp32 runs too, so fp32 MFU reads against bf16's peak), the peak
memory (torch.cuda.max_memory_allocated; ours from metrics' memory.peak_bytes) and the eval loss
(computed on the GPU in fp32). Without a GPU `--backends cuda` stops in one line.

Reports, from each run's metrics JSON (TRL: from its worker's JSON): the whole command's wall time,
train_seconds (TRL: `train_runtime`), tokens/s (padding included), trained tokens/s (tokens in the
loss), the padding share, the trained tokens (in all and per step), documents per step (mean),
compilations and their seconds (XLA) and the final validation loss; train_seconds, and so the
token rates, include XLA's compilations. A second table gives ours (packed) against TRL per
backend. Prints and writes OUT/sft.json and OUT/sft.md (OUT defaults to benchmarks/out/sft);
each run's output is kept in OUT/CASE.log, its model in OUT/CASE-model.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("packed", "padded", "trl")
ENV = {"PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"}
# --shape: the model when --model is not given, and the run's defaults where not given on the command line
SHAPES = {
    "tiny": {"max_length": 64, "batch_size": 8, "lr": 3e-3, "max_steps": 150},
    "1b": {"max_length": 2048, "batch_size": 8, "lr": 1e-4, "max_steps": 40},
}
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, tie_word_embeddings=True, rope_theta=500000.0)
# dense bf16 FLOP/s by a part of torch.cuda.get_device_name (NVIDIA's data sheets), for MFU
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
# the package's cases on a GPU: (name suffix, extra flags)
CUDA_VARIANTS = (("", []), ("-compile", ["--compile"]), ("-gc", ["--gradient-checkpointing"]),
                 ("-compile-gc", ["--compile", "--gradient-checkpointing"]))


def synthetic(out, args):
    """The tests' synthetic task where --model, --train-file or --validation-file is not given."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_decoders as td

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    if args.shape == "1b":
        args.model = args.model or str(llama_1b(data / "llama-1b", td))
        if not args.train_file:
            args.train_file, validation = mrpc_rows(data, 3000, 32)
            args.validation_file = args.validation_file or validation
        return
    if not args.model:
        args.model = str(td.save("llama", data / "llama", chat=True, letters=True))
    if not args.train_file:
        args.train_file = str(td.write_jsonl(data / "train.jsonl", td.reverse_rows(4000, 1)))
        if not args.validation_file:
            args.validation_file = str(td.write_jsonl(data / "validation.jsonl", td.reverse_rows(64, 2)))


def llama_1b(folder, td):
    """A Llama-3.2-1B-shaped model with random weights (seed 0) and the bundled vocabulary, made once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = td.tokenizer(chat=False)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=None, **LLAMA_1B)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # the init on the GPU where there is one
        model = LlamaForCausalLM(cfg)
    model.to("cpu").save_pretrained(folder)
    tok.save_pretrained(folder)
    print(f"   {folder}: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    return folder


def mrpc_rows(data, n_train, n_validation):
    """Prompt/completion rows made of the bundled MRPC's sentences (a prompt of 2 to 30, a completion
    of 1 to 16: 100 to 1,250 tokens), seed 1; returns the training and validation files."""
    import random

    from xla_train.tasks import BUNDLED_MRPC

    sentences = []
    for line in (BUNDLED_MRPC / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]:
        parts = line.split("\t")
        sentences += [parts[3], parts[4]]
    rng = random.Random(1)

    def rows(n):
        return [{"prompt": " ".join(rng.sample(sentences, rng.randint(2, 30))),
                 "completion": " " + " ".join(rng.sample(sentences, rng.randint(1, 16)))} for _ in range(n)]

    files = data / "mrpc-train.jsonl", data / "mrpc-validation.jsonl"
    for path, n in zip(files, (n_train, n_validation)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(n)), encoding="utf-8")
    return tuple(map(str, files))


def peak_bf16(device):
    """The card's dense bf16 FLOP/s by its name, or None (the CPU, a card not listed)."""
    return next((f for part, f in PEAK_BF16.items() if device and part in device), None)


def launch(name, cmd, env, out):
    """One case in a fresh process; returns (its wall seconds, its stdout, the error's last line or None)."""
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **ENV, **env})
    wall = time.perf_counter() - start
    (out / f"{name}.log").write_text(" ".join(cmd) + "\n\n" + proc.stdout + proc.stderr)
    if not proc.returncode:
        return wall, proc.stdout, None
    raised = [line for line in proc.stderr.splitlines() if re.match(r"[\w.]+(Error|Exception): ", line)]
    return wall, proc.stdout, (raised or proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


def run(backend, mode, steps, args, out, seed, variant=("", [])):
    name = f"{backend}-{mode}{variant[0]}" + seeded(seed, args)
    metrics = out / f"{name}.json"
    cmd = [sys.executable, "-m", "xla_train", "train", "--problem", "causal-lm", "--backend", backend,
           "--model", args.model, "--train-file", args.train_file, "--max-length", str(args.max_length),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--warmup-ratio", str(args.warmup_ratio),
           "--max-steps", str(steps), "--eval-every", str(steps), "--seed", str(seed), "--metrics-out", str(metrics),
           "--output-dir", str(out / f"{name}-model"), "--overwrite"]
    cmd += ["--validation-file", args.validation_file] if args.validation_file else []
    cmd += ["--packing"] if mode == "packed" else ["--no-packing", "--buckets", args.buckets]
    cmd += ["--precision", args.precision, *variant[1]]
    metrics.unlink(missing_ok=True)
    wall, stdout, error = launch(name, cmd, {}, out)
    if error:
        sys.exit(f"{name} failed (see {out / name}.log): {error}")
    m = json.loads(metrics.read_text())
    packed = re.search(r"packed (\d+) train documents into (\d+) rows", stdout)
    docs_per_row = int(packed[1]) / int(packed[2]) if packed else 1.0  # --no-packing: a row per document
    tokens = m["tokens"]
    return {"case": name, "backend": backend, "mode": mode, "seed": seed, "steps": m["steps"], "wall_s": round(wall, 1),
            "train_s": m["train_seconds"], "tokens_per_s": tokens["per_s"], "trained_per_s": tokens["trained_per_s"],
            "padding_share": tokens["padding_share"], "tokens_padded": tokens["padded"], "tokens_real": tokens["real"],
            "tokens_trained": tokens["trained"], "trained_per_step": round(tokens["trained"] / m["steps"], 1),
            "docs_per_row": round(docs_per_row, 3),
            "docs_per_step": round(m["train_samples"] / m["steps"] * docs_per_row, 1), "buckets": m["buckets"],
            "compiles": (m["xla"] or m.get("torch_compile") or {}).get("compiles"),
            "compile_s": (m["xla"] or m.get("torch_compile") or {}).get("compile_seconds"),
            "own_eval_loss": m["eval"]["loss"], "device": m["device"], "params": m["total_params"],
            # steady: the rate after the last compilation, in tokens (a row's mean padded tokens)
            "steady_tokens_per_s": m["steady_samples_per_s"] * tokens["padded"] / max(m["train_samples"], 1),
            "peak_bytes": m["memory"]["peak_bytes"]}


def run_trl(name, backend, steps, args, out, optim=None, pad=None, seed=None, checkpointing=False, attention=None):
    """TRL's SFTTrainer in a fresh process (trl_worker); a row like run's, or one with its error."""
    seed = args.seeds[0] if seed is None else seed
    name += seeded(seed, args)
    result = out / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--trl-worker", json.dumps({**vars(args), "steps": steps, "optim": optim,
                                                                  "pad": pad, "backend": backend, "seed": seed,
                                                                  "checkpointing": checkpointing,
                                                                  "attention": attention, "out": str(out / name)})]
    wall, _, error = launch(name, cmd, {"USE_TORCH_XLA": "0"} if backend == "cpu" else {}, out)
    row = {"case": name, "backend": backend, "mode": "trl", "seed": seed,
           "optim": optim or "default (adamw_torch_fused)", "pad_to_multiple_of": pad,
           "gradient_checkpointing": "default (on)" if checkpointing is None else checkpointing,
           "attention": attention or "default (sdpa)"}
    if error:
        print(f"   {name} does not run: {error}", flush=True)
        return {**row, "error": error, "wall_s": round(wall, 1)}
    m = json.loads(result.read_text())
    return {**row, "steps": m["steps"], "wall_s": round(wall - m["check_s"], 1), "train_s": m["train_s"],
            "tokens_per_s": m["tokens"] / m["train_s"], "trained_per_s": m["trained"] / m["train_s"],
            "padding_share": 1 - m["real"] / m["tokens"], "tokens_padded": m["tokens"], "tokens_real": m["real"],
            "tokens_trained": m["trained"], "trained_per_step": round(m["trained"] / m["steps"], 1),
            "docs_per_row": round(m["docs"] / m["rows"], 3), "docs_per_step": round(m["docs"] / m["steps"], 1),
            "buckets": None, "shapes": m["shapes"], "compiles": m["compiles"], "compile_s": m["compile_s"],
            "own_eval_loss": m["eval_loss"], "eval_s": m["eval_s"], "same_documents": m["same_documents"],
            "device": m["device"], "params": m["params"], "steady_tokens_per_s": m["steady_tokens_per_s"],
            "peak_bytes": m["peak_bytes"]}


def trl_worker(spec):
    """Trains with TRL's SFTTrainer as the docstring says, counting each batch's tokens as TRL's
    collator makes it (the first `steps` batches: the loaders fetch ahead), saves the model into
    OUT-model, then compares TRL's packed documents with the package's tokenisation; writes OUT.json."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    s = argparse.Namespace(**spec)
    tokenizer = AutoTokenizer.from_pretrained(s.model)
    train = datasets.load_dataset("json", data_files=s.train_file, split="train")
    validation = datasets.load_dataset("json", data_files=s.validation_file, split="train")
    cuda = s.backend == "cuda"
    # None: TRL's default (gradient checkpointing on), else what the package's case does
    checkpointing = {} if s.checkpointing is None else {"gradient_checkpointing": s.checkpointing}
    config = SFTConfig(output_dir=s.out + "-model", max_length=s.max_length, packing=True, packing_strategy="bfd",
                       completion_only_loss=True, per_device_train_batch_size=s.batch_size,
                       per_device_eval_batch_size=s.batch_size, learning_rate=s.lr, lr_scheduler_type="linear",
                       warmup_steps=int(s.warmup_ratio * s.steps), max_steps=s.steps, weight_decay=0.0,
                       max_grad_norm=0.0, bf16=s.precision == "bf16", **checkpointing, seed=s.seed, report_to=[],
                       save_strategy="no", use_cpu=s.backend == "cpu", pad_to_multiple_of=s.pad,
                       **({"optim": s.optim} if s.optim else {}))
    model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32,
                                                 **({"attn_implementation": s.attention} if s.attention else {}))
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, eval_dataset=validation,
                         processing_class=tokenizer)
    counts, collate, stamps = [], trainer.data_collator, []

    class Clock(TrainerCallback):
        """Each optimizer step's end, the device's queue drained: the steady rate's clock."""

        def on_step_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    trainer.add_callback(Clock())

    def counting(examples):
        batch = collate(examples)
        counts.append((batch["input_ids"].numel(), sum(sum(e["seq_lengths"]) for e in examples),
                       int((batch["labels"] != -100).sum()), sum(len(e["seq_lengths"]) for e in examples),
                       len(examples), tuple(batch["input_ids"].shape)))
        return batch

    trainer.data_collator = counting
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    train_s = trainer.train().metrics["train_runtime"]
    peak_bytes = torch.cuda.max_memory_allocated() if cuda else None
    used, counts[:] = counts[: s.steps], []
    first = max(1, len(stamps) // 4)  # steady: after the first quarter of the steps (compilations, warm-up)
    steady_tokens = sum(c[0] for c in used[first:len(stamps)])
    steady = steady_tokens / (stamps[-1] - stamps[first - 1]) if len(stamps) > first else None
    start = time.perf_counter()
    eval_loss = trainer.evaluate()["eval_loss"]
    eval_s = time.perf_counter() - start
    trainer.save_model(s.out + "-model")
    compiles = compile_s = None
    if s.backend == "xla":
        import torch_xla.debug.metrics as met

        compiles, ns = (met.metric_data("CompileTime") or (0, 0))[:2]
        compile_s = round(ns / 1e9, 1)
    start = time.perf_counter()
    same = same_documents(trainer.train_dataset, train, tokenizer, s.max_length)
    tokens, real, trained, docs, rows, shapes = zip(*used)
    Path(s.out + ".json").write_text(json.dumps({
        "steps": len(used), "train_s": train_s, "tokens": sum(tokens), "real": sum(real), "trained": sum(trained),
        "docs": sum(docs), "rows": sum(rows), "shapes": len(set(shapes)), "compiles": compiles,
        "compile_s": compile_s, "eval_loss": eval_loss, "eval_s": round(eval_s, 1), "same_documents": same,
        "device": torch.cuda.get_device_name() if cuda else s.backend, "steady_tokens_per_s": steady,
        "peak_bytes": peak_bytes, "params": sum(p.numel() for p in trainer.model.parameters()),
        "check_s": time.perf_counter() - start}))


def same_documents(packed, rows, tokenizer, max_length):
    """Whether TRL's packed rows hold, document for document, what the package makes of `rows`:
    the same token ids, and TRL's labels (the model shifts them) one step behind ours."""
    from xla_train.tasks.causal_lm import IGNORE, documents, form_of

    ours, _, _ = documents(rows, form_of(rows, "train"), tokenizer, max_length, "train")
    theirs = []
    for row in packed:
        start = 0
        for n in row["seq_lengths"]:
            ids, labels = row["input_ids"][start:start + n], row["labels"][start:start + n]
            theirs.append((ids, labels[1:] + [IGNORE]))
            start += n
    return sorted(ours) == sorted(theirs)


def validation_loss(folder, validation_file, max_length, device="cpu"):
    """A saved model's token-weighted validation loss, on the CPU in fp32: each document alone,
    tokenised as the package tokenises it, the cross-entropy summed over the trained tokens and
    divided by their number."""
    import datasets
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from xla_train.tasks.causal_lm import IGNORE, documents, form_of

    rows = datasets.load_dataset("json", data_files=validation_file, split="train")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    docs, _, _ = documents(rows, form_of(rows, validation_file), tokenizer, max_length, validation_file)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for ids, labels in docs:
            logits = model(torch.tensor([ids], device=device)).logits[0].float()
            total += F.cross_entropy(logits, torch.tensor(labels, device=device), ignore_index=IGNORE,
                                     reduction="sum").item()
            n += sum(label != IGNORE for label in labels)
    return total / n


def seeded(seed, args):
    """A case's name suffix: none for the first of --seeds (the tables' rows), `-seedN` for the others."""
    return "" if seed == args.seeds[0] else f"-seed{seed}"


def over_seeds(rows):
    """Each first-seed row gets `eval_losses` (every seed's eval loss of its case) and their mean."""
    for r in rows:
        if "error" not in r and "-seed" not in r["case"]:
            r["eval_losses"] = [o["eval_loss"] for o in rows if "error" not in o and
                                o["case"].split("-seed")[0] == r["case"]]
            r["eval_mean"] = sum(r["eval_losses"]) / len(r["eval_losses"])


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def tables(rows, commit, date, model, data, args):
    md = [f"Command: `python benchmarks/bench_sft.py {' '.join(sys.argv[1:])}` (commit {commit}, {date}; "
          f"{model} on {data}, --max-length {args.max_length}, batch {args.batch_size}, lr {args.lr:g}, padded "
          f"--buckets {args.buckets})\n",
          "| case | steps | wall s | train s | tokens/s | trained tokens/s | padding share | trained tokens "
          "| trained tokens/step | docs/step | buckets | compiles (s) | eval loss | own eval loss "
          f"| eval loss over seeds {','.join(map(str, args.seeds))}: mean (min-max) |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            error = r["error"].replace("`", "'")  # one code span
            md.append(f"| {r['case']} | does not run: `{error}` |" + " |" * 13)
            continue
        if "-seed" in r["case"]:
            continue  # in its case's last column
        losses = r["eval_losses"]
        compiles = f"{r['compiles']} ({r['compile_s']:.1f})" if r["compiles"] is not None else "-"
        md.append(f"| {r['case']} | {r['steps']} | {r['wall_s']} | {r['train_s']:.1f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['trained_per_s']:,.0f} | {r['padding_share']:.3f} | {r['tokens_trained']:,} | "
                  f"{r['trained_per_step']:,.1f} | {r['docs_per_step']} | "
                  f"{','.join(map(str, r['buckets'])) if r['buckets'] else '-'} | "
                  f"{compiles} | {r['eval_loss']:.4f} | {r['own_eval_loss']:.4f} | "
                  f"{r['eval_mean']:.4f} ({min(losses):.4f}-{max(losses):.4f}) |")
    by = {r["case"]: r for r in rows if "error" not in r}
    pairs = [(b, by[f"{b}-packed"], by[f"{b}-trl"]) for b in args.backends.split(",")
             if f"{b}-packed" in by and f"{b}-trl" in by]
    if pairs:
        md += ["", "| backend | trained tokens/s ours / TRL | train s TRL / ours | wall s TRL / ours | "
                   "eval loss ours / TRL, mean over seeds | goal |", "| --- | ---: | ---: | ---: | ---: | --- |"]
        for b, ours, trl in pairs:
            md.append(f"| {b} | {ours['trained_per_s'] / trl['trained_per_s']:.2f}x | "
                      f"{trl['train_s'] / ours['train_s']:.2f}x | {trl['wall_s'] / ours['wall_s']:.2f}x | "
                      f"{ours['eval_mean']:.4f} / {trl['eval_mean']:.4f} | "
                      f">= {'2' if b == 'xla' else '1.0'}x at equal or lower loss |")
    gpu = [r for r in rows if r["backend"] == "cuda" and "-seed" not in r["case"]]
    if gpu:
        md += ["", f"On {next((r['device'] for r in gpu if 'error' not in r), 'the GPU')}, --precision "
                   f"{args.precision}; MFU = 6 x parameters x tokens/s / the card's dense bf16 peak",
               "| case | tokens/s | steady tokens/s | MFU | steady MFU | peak memory GB | compiles (s) | eval loss |",
               "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in gpu:
            if "error" in r:
                md.append(f"| {r['case']} | does not run: `{r['error'].replace('`', chr(39))}` |" + " |" * 6)
                continue
            peak = peak_bf16(r["device"])

            def mfu(rate, r=r, peak=peak):
                return f"{6 * r['params'] * rate / peak:.1%}" if peak and rate else "-"

            steady = r["steady_tokens_per_s"]
            compiles = f"{r['compiles']} ({r['compile_s']:.1f})" if r["compiles"] is not None else "-"
            md.append(f"| {r['case']} | {r['tokens_per_s']:,.0f} | {f'{steady:,.0f}' if steady else '-'} | "
                      f"{mfu(r['tokens_per_s'])} | {mfu(steady)} | "
                      f"{r['peak_bytes'] / 1e9:.1f} | {compiles} | {r['eval_loss']:.4f} |"
                      if r["peak_bytes"] is not None else f"| {r['case']} | no peak memory |" + " |" * 6)
    return "\n".join(md)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps of every run (default: 150; "
                   "--shape 1b: 40)")
    p.add_argument("--backends", default="cpu,xla", help="comma-separated: cpu, xla (XLA:CPU), cuda (a GPU: the "
                   "package eager and --compile, with and without --gradient-checkpointing, and TRL three ways)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny", help="the model where --model is not given: "
                   "tiny (the tests' tiny Llama on the synthetic task) or 1b (Llama-3.2-1B-shaped, random weights, "
                   "the bundled vocabulary, on prompt/completion rows of MRPC sentences)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="both trainers: fp32, or bf16 autocast (ours --precision bf16, TRL's bf16=True)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: packed, padded, trl")
    p.add_argument("--same-documents", action="store_true",
                   help="padded runs take --max-steps x the packed rows' mean documents per row steps")
    p.add_argument("--buckets", default="auto", help="the padded runs' --buckets")
    p.add_argument("--model", default=None, help="a causal LM's folder or hub name (default: the tiny Llama)")
    p.add_argument("--train-file", default=None, help="default: the synthetic task's 4,000 rows")
    p.add_argument("--validation-file", default=None, help="default: the synthetic task's 64 rows with the "
                   "synthetic training rows, else the CLI's held-out share of --train-file (trl needs it)")
    p.add_argument("--max-length", type=int, default=None, help="default: 64; --shape 1b: 2048")
    p.add_argument("--batch-size", type=int, default=None, help="default: 8")
    p.add_argument("--lr", type=float, default=None, help="default: 3e-3; --shape 1b: 1e-4")
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--seeds", default="42", help="comma-separated --seed values (the data order; TRL's seed): the "
                   "packed and trl cases train once per seed, the first seed's runs are the table's rows, and the "
                   "eval loss is also given as the mean over the seeds")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "sft"))
    p.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(json.loads(args.trl_worker))
    args.seeds = [int(x) for x in args.seeds.split(",")]
    for key, value in SHAPES[args.shape].items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    backends = args.backends.split(",")
    unknown = set(backends) - {"cpu", "xla", "cuda"}
    if unknown:
        sys.exit(f"bench_sft: unknown --backends {','.join(sorted(unknown))} (cpu, xla, cuda)")
    if "cuda" in backends:
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench_sft: --backends cuda needs a CUDA GPU, and torch sees none here "
                     "(torch.cuda.is_available() is False)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or {"tiny": "the tests' tiny Llama", "1b": "a Llama-3.2-1B-shaped model"}[args.shape]
    data = args.train_file or {"tiny": "the synthetic reverse task", "1b": "MRPC-sentence prompt/completion rows"}[
        args.shape]
    synthetic(out, args)
    modes, rows = args.modes.split(","), []
    for backend in backends:
        first, *others = args.seeds
        packed = run(backend, "packed", args.max_steps, args, out, first) if "packed" in modes else None
        if backend == "cuda" and packed:  # --compile, and gradient checkpointing, eager and compiled
            rows += [run(backend, "packed", args.max_steps, args, out, first, v) for v in CUDA_VARIANTS[1:]]
        rows += [packed] if packed else []
        rows += [run(backend, "packed", args.max_steps, args, out, seed) for seed in others if packed]
        if "padded" in modes:
            steps = round(args.max_steps * packed["docs_per_row"]) if args.same_documents and packed else args.max_steps
            rows.append(run(backend, "padded", steps, args, out, first))
        if "trl" in modes and backend == "cuda":  # TRL's defaults, then equal settings without and with checkpointing
            import importlib.util

            attention = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flex_attention"
            rows += [run_trl("cuda-trl-defaults", backend, args.max_steps, args, out, checkpointing=None),
                     *[run_trl("cuda-trl", backend, args.max_steps, args, out, seed=seed, attention=attention)
                       for seed in args.seeds],
                     run_trl("cuda-trl-gc", backend, args.max_steps, args, out, checkpointing=True,
                             attention=attention)]
        elif "trl" in modes and backend == "cpu":
            rows += [run_trl("cpu-trl", backend, args.max_steps, args, out, seed=seed) for seed in args.seeds]
        elif "trl" in modes:  # transformers' default optimizer, then the unfused one, then one shape for every batch
            rows += [run_trl("xla-trl-default", backend, args.max_steps, args, out),
                     *[run_trl("xla-trl", backend, args.max_steps, args, out, "adamw_torch", seed=seed)
                       for seed in args.seeds],
                     run_trl("xla-trl-static", backend, args.max_steps, args, out, "adamw_torch",
                             args.batch_size * args.max_length)]
    for r in rows:
        if "error" not in r:
            r["eval_loss"] = validation_loss(out / f"{r['case']}-model", args.validation_file, args.max_length,
                                             "cuda" if r["backend"] == "cuda" else "cpu")
    over_seeds(rows)
    dirty = git("status", "--porcelain", "--untracked-files=no")
    commit = git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    date = datetime.datetime.now().isoformat(timespec="seconds")
    load = os.getloadavg()
    table = tables(rows, commit, date, model, data, args) + f"\n\nLoad average at the end (1, 5, 15 min): {load}"
    print(table)
    (out / "sft.json").write_text(json.dumps({"commit": commit, "date": date, "command": sys.argv, "load": load,
                                              "args": vars(args), "rows": rows}, indent=1) + "\n")
    (out / "sft.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
