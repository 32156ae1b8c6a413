source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call54.sh $OUT/
mkdir -p /tmp/res
cp bench/results/2026-11-26-s12-2xH100/call53/nvlink32k/static/ds_stpar.json /tmp/static.json
T0=$(date +%s)
run() { # name limit
  timeout $2 deepspeed --num_gpus 2 launch/pretrain.py --config /tmp/static.json --data .gpu/stdlib.jsonl \
    --tokenizer .gpu/stdlib-bpe32k.json --steps 3 --seed 1234 --out /tmp/res/$1 > /tmp/res/$1.log 2>&1
  echo "$1 rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "^step" /tmp/res/$1.log | cut -c1-120
  grep -h peak_reserved /tmp/res/$1/metrics.jsonl | python3 -c "import sys,json; [print(json.loads(l)['step'], round(json.loads(l)['peak_reserved_gib'],1), round(json.loads(l)['peak_gib'],1)) for l in sys.stdin]"
  tar czf $OUT/call54.tgz -C /tmp/res .
}
run no-record-stream 105
cp .gpu/comm_recordstream.py ds_stpar/layers/comm.py
TORCH_NCCL_AVOID_RECORD_STREAMS=0 run record-stream 105
