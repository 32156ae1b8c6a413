source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call55.sh $OUT/
mkdir -p /tmp/res
cp bench/results/2026-11-26-s12-2xH100/call53/nvlink32k/static/ds_stpar.json /tmp/static.json
T0=$(date +%s); ROOT=$PWD
run() { # name tree limit [extra]
  ( cd $2 && PYTHONPATH=$PWD:/tmp/site timeout $3 deepspeed --num_gpus 2 launch/pretrain.py --config /tmp/static.json --data $ROOT/.gpu/stdlib.jsonl \
    --tokenizer $ROOT/.gpu/stdlib-bpe32k.json --steps 3 --seed 1234 --out /tmp/res/$1 $4 > /tmp/res/$1.log 2>&1 )
  echo "$1 rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "^step" /tmp/res/$1.log | cut -c1-120
  python3 -c "
import json
for l in open('/tmp/res/$1/metrics.jsonl'):
    d=json.loads(l); print(d['step'], round(d['step_s'],2), round(d['peak_gib'],1), round(d.get('peak_reserved_gib',0),1), d.get('alloc_retries'))"
  tar czf $OUT/call55.tgz -C /tmp/res .
}
run head $ROOT 140 "--trace-step 3"
run old97d711b $ROOT/.gpu/t97d711b 120
run oldefd59f1 $ROOT/.gpu/tefd59f1 120
python3 bench/timeline.py /tmp/res/head/trace-step-3-rank-*.json.gz 2>&1 | head -60
tar czf $OUT/call55.tgz -C /tmp/res .
