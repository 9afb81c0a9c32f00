#!/usr/bin/env bash
# --problem dpo in the combinations users run (bf16, LoRA merged then predict, XLA fsdp and spmd on 1 and
# 4 XLA:CPU devices, two gloo processes under ddp and fsdp), 20 steps of the tests' tiny pair task each:
# every run's exit status and evaluation. Not timed tests: each is a minute of make test.
#     bash benchmarks/dpo_combinations.sh            # OUT=DIR to keep the runs elsewhere
set -u
cd "$(dirname "$0")/.."
D=${OUT:-runs/dpo-combinations}; rm -rf "$D"; mkdir -p "$D"
.venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); import tiny_decoders as td; \
from test_dpo import pairs; td.save('llama', '$D/tiny-llama', chat=True, letters=True); \
td.write_jsonl('$D/train.jsonl', pairs(400, 1)); td.write_jsonl('$D/val.jsonl', pairs(32, 2))" 2>/dev/null
COMMON="--problem dpo --model $D/tiny-llama --train-file $D/train.jsonl --validation-file $D/val.jsonl --max-length 32 --buckets 32 --batch-size 8 --lr 3e-3 --max-steps 20 --log-every 10"
run() { name=$1; shift; echo "== $name"; env ${ENVV:-} PJRT_DEVICE=CPU timeout 600 .venv/bin/xla-train train $COMMON "$@" --metrics-out $D/$name.json > $D/$name.log 2>&1; echo "rc=$?"; grep -E "^dev |error|Error" $D/$name.log | tail -2; }
run cpu-bf16 --backend cpu --precision bf16
run cpu-lora-merge --backend cpu --lora --lora-targets q_proj,v_proj --merge-lora --output-dir $D/merged
run xla-fsdp --backend xla --strategy fsdp
ENVV=CPU_NUM_DEVICES=4 run xla-fsdp4 --backend xla --strategy fsdp
ENVV=CPU_NUM_DEVICES=4 run xla-spmd4 --backend xla --strategy spmd
run cpu-ddp2 --backend cpu --num-processes 2
run cpu-fsdp2 --backend cpu --strategy fsdp --num-processes 2
echo '{"prompt": "reverse c a b ="}' > $D/prompts.jsonl
echo "== predict"; timeout 300 .venv/bin/xla-train predict --backend cpu --model $D/merged --input $D/prompts.jsonl --output $D/pred.jsonl > $D/predict.log 2>&1; echo "rc=$?"; tail -2 $D/predict.log; cat $D/pred.jsonl 2>/dev/null | head -2
