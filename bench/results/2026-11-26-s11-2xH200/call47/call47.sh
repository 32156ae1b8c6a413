source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call47.sh .gpu/syncdebug.py $OUT/
mkdir -p /tmp/res
python3 .gpu/short16k.py
timeout 200 deepspeed --num_gpus 2 .gpu/syncdebug.py --config .gpu/cfg39/B-linear-norc-mb1.json --data .gpu/short16k.jsonl \
    --tokenizer .gpu/stdlib-bpe32k.json --steps 2 --seed 1234 --out /tmp/res/B > /tmp/res/B.log 2>&1
echo rc=$?
grep -E "^step" /tmp/res/B.log; grep -c "SYNC " /tmp/res/B.log; grep "SYNCCOUNT" /tmp/res/B.log | head -20
cp /tmp/res/B.log $OUT/
