source .gpu/setup.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .gpu/call60.sh $OUT/
A="--data .gpu/stdlib.jsonl --tokenizer .gpu/stdlib-bpe32k.json"
timeout 80 python3 bench/attention.py $A --edges 16384,32768 --bucket 0 2>&1 | tee $OUT/short16k.txt | grep -v Warning
timeout 80 python3 bench/attention.py $A --edges 32768 2>&1 | tee $OUT/static32k.txt | grep -v Warning
