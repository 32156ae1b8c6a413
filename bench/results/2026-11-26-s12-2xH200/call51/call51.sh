source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call51.sh $OUT/
mkdir -p /tmp/res
timeout 120 python3 -m pytest -q tests/test_attention_gpu.py 2>&1 | tail -4 | tee /tmp/res/gpu-tests.txt
python3 .gpu/short16k.py
T0=$(date +%s)
run() { # name config steps trace-step limit [env]
  name=$1
  env $6 timeout $5 deepspeed --num_gpus 2 launch/pretrain.py --config .gpu/cfg39/$2.json --data .gpu/short16k.jsonl \
    --tokenizer .gpu/stdlib-bpe32k.json --steps $3 --seed 1234 --out /tmp/res/$name --trace-step $4 > /tmp/res/$name.log 2>&1
  echo "$name rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "^step" /tmp/res/$name.log | cut -c1-200
}
run B-fused-rope B-linear-norc-mb1 3 3 150
run B-megatron-rope B-linear-norc-mb1 3 3 150 DS_STPAR_FUSED_ROPE=0
python3 bench/timeline.py /tmp/res/*/trace-step-3-rank-*.json.gz | tee /tmp/res/timeline.txt
mkdir -p /tmp/traces; for n in B-fused-rope; do cp /tmp/res/$n/trace-step-3-rank-0.json.gz /tmp/traces/$n-rank0.json.gz; done
rm -f /tmp/res/*/trace-step-*.json.gz
tar czf $OUT/call51.tgz -C /tmp/res .
cp /tmp/traces/* $OUT/
