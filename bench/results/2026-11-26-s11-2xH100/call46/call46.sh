source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call46.sh $OUT/
mkdir -p /tmp/res
python3 .gpu/short16k.py
T0=$(date +%s)
run() { # name steps profile-step limit
  name=$1; prof=""; [ "$3" != 0 ] && prof="--profile-step $3"
  timeout $4 deepspeed --num_gpus 2 launch/pretrain.py --config .gpu/cfg39/$name.json --data .gpu/short16k.jsonl \
    --tokenizer .gpu/stdlib-bpe32k.json --steps $2 --seed 1234 --out /tmp/res/$name $prof > /tmp/res/$name.log 2>&1
  echo "$name rc=$? t=$(( $(date +%s) - T0 ))"; grep -E "^step" /tmp/res/$name.log
}
run B-linear-norc-mb1 3 3 200
run D-linear-rc-mb4 3 0 150
tar czf $OUT/call46.tgz -C /tmp/res .
