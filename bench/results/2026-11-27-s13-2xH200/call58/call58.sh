source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call58.sh $OUT/
mkdir -p /tmp/res
cp bench/results/2026-11-27-s13-2xH200/call57/nvlink32k/planned/ds_stpar.json /tmp/planned.json
T0=$(date +%s)
timeout 150 deepspeed --num_gpus 2 launch/pretrain.py --config /tmp/planned.json --data .gpu/stdlib.jsonl \
    --tokenizer .gpu/stdlib-bpe32k.json --steps 3 --seed 1234 --out /tmp/res/planned --trace-step 3 > /tmp/res/planned.log 2>&1
echo "planned rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "^step" /tmp/res/planned.log | cut -c1-160
python3 bench/timeline.py /tmp/res/planned/trace-step-3-rank-*.json.gz --top 12 > /tmp/res/timeline.txt 2>&1
tar czf $OUT/call58.tgz -C /tmp/res .
cut -c1-180 /tmp/res/timeline.txt
