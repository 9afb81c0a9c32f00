"""Fine-tune on GLUE MRPC: the same job as `xla-train train`, as a script.

    python scripts/train_mrpc.py                                   # auto backend, bundled model and data
    PJRT_DEVICE=CPU python scripts/train_mrpc.py --backend xla     # XLA on the CPU
    python scripts/train_mrpc.py --backend cpu --num-processes 2   # two gloo workers
    python scripts/train_mrpc.py --model bert-base-uncased --data-dir hub   # where the hub is reachable
"""

import sys

from xla_train.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
