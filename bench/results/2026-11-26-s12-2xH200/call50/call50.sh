source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call50.sh $OUT/
mkdir -p /tmp/res
python3 .gpu/short16k.py
T0=$(date +%s)
run() { # name steps trace-step limit
  name=$1
  timeout $4 deepspeed --num_gpus 2 launch/pretrain.py --config .gpu/cfg39/$name.json --data .gpu/short16k.jsonl \
    --tokenizer .gpu/stdlib-bpe32k.json --steps $2 --seed 1234 --out /tmp/res/$name --trace-step $3 > /tmp/res/$name.log 2>&1
  echo "$name rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "^step" /tmp/res/$name.log | cut -c1-200
}
run B-linear-norc-mb1 3 3 150
run D-linear-rc-mb4 3 3 150
run E-megatron-norc-mb1 3 3 150
python3 bench/timeline.py /tmp/res/*/trace-step-3-rank-*.json.gz | tee /tmp/res/timeline.txt
ls -la /tmp/res/*/
mkdir -p /tmp/traces; for n in B-linear-norc-mb1 D-linear-rc-mb4 E-megatron-norc-mb1; do cp /tmp/res/$n/trace-step-3-rank-0.json.gz /tmp/traces/$n-rank0.json.gz; done
rm -f /tmp/res/*/trace-step-*.json.gz
tar czf $OUT/call50.tgz -C /tmp/res .
for f in /tmp/traces/*; do s=$(stat -c %s $f); [ $s -lt 15000000 ] && cp $f $OUT/; done
ls -la $OUT
