source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call49.sh .gpu/syncdebug.py .gpu/cfg49/pp2.json $OUT/
mkdir -p /tmp/res
python3 .gpu/short16k.py
timeout 170 deepspeed --num_gpus 2 .gpu/syncdebug.py --config .gpu/cfg49/pp2.json --data .gpu/short16k.jsonl \
    --tokenizer .gpu/stdlib-bpe32k.json --steps 1 --seed 1234 --out /tmp/res/pp2 > /tmp/res/pp2.log 2>&1
echo rc=$?
grep -E "^step" /tmp/res/pp2.log; grep -c "SYNC " /tmp/res/pp2.log; grep "SYNCCOUNT" /tmp/res/pp2.log | head -20
cp /tmp/res/pp2.log $OUT/
