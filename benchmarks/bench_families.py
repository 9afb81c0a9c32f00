"""XLA graph hygiene per model family: tiny random BERT, RoBERTa, DistilBERT, ELECTRA, ModernBERT
and DeBERTa-v2 models (the configs of tests/test_families.py, the bundled tokenizer), each trained
20 steps on XLA:CPU with one bucket on the first 160 MRPC training rows, 80 dev rows (10 batches).

    python benchmarks/bench_families.py                      # this checkout
    python benchmarks/bench_families.py --repo OTHER_CHECKOUT  # the same runs with another version

Prints and writes OUT/families.md and OUT/families.json (OUT defaults to benchmarks/out/families).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=str(ROOT), help="the checkout whose xla_train runs the job")
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out" / "families"))
    args = p.parse_args()
    import torch
    from conftest import write_slice
    from test_families import SIZE, configs
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
    )

    from xla_train.models import bundled_model_path

    out = Path(args.out_dir)
    data = write_slice(out / "mrpc", 160, 80)
    tok = AutoTokenizer.from_pretrained(bundled_model_path())
    families = {"bert": BertConfig(vocab_size=tok.vocab_size, hidden_size=32, **SIZE), **configs(tok.vocab_size)}
    rows = {}
    for name, config in families.items():
        torch.manual_seed(0)
        config.num_labels = 2
        AutoModelForSequenceClassification.from_config(config).save_pretrained(out / name)
        tok.save_pretrained(out / name)
        metrics = out / f"{name}.json"
        proc = subprocess.run([sys.executable, "-m", "xla_train", "train", "--backend", "xla", "--model",
                               str(out / name), "--data-dir", str(data), "--max-steps", "20", "--buckets", "128",
                               "--metrics-out", str(metrics)], cwd=args.repo, capture_output=True, text=True,
                              env={**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": args.repo})
        if proc.returncode:
            rows[name] = {"error": proc.stderr.strip().splitlines()[-1]}
        else:
            rows[name] = json.loads(metrics.read_text())["xla"]
        print(name, rows[name], flush=True)
    md = [f"Command: `python benchmarks/bench_families.py {' '.join(sys.argv[1:])}`\n",
          "| family | compiles | host syncs / step | aten fallbacks | graph executions (20 steps + 10 eval batches) |",
          "| --- | ---: | ---: | ---: | ---: |"]
    for name, x in rows.items():
        md.append(f"| {name} | " + (" | ".join(str(x[k]) for k in ("compiles", "host_syncs_per_step", "aten_fallbacks",
                                                                     "executions")) if "error" not in x
                                     else f"failed: {x['error']} | | |") + " |")
    (out / "families.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "families.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
