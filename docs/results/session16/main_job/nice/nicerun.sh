#!/bin/bash
# usage: nicerun.sh OUTDIR NAME ENGINE_NICE ROLLOUT_NICE TRAINER_NICE
O=$1; N=$2; EN=$3; RN=$4; TN=$5; mkdir -p $O
cd /work/main
head -1 /proc/stat > $O/$N.stat0
python experiments/tiny_cpu.py --minutes 2 --no-progress --log-dir $O/tb_$N > $O/$N.log 2>&1 &
P=$!
renice -n $TN -p $P >/dev/null
for i in $(seq 1 120); do
  sleep 1
  R=$(ps -eo pid,args | grep "spawn_main" | grep -v grep | awk '{print $1}' | head -1)
  if [ -n "$R" ]; then break; fi
done
for e in $(ps -eo pid,args | grep "rlcore.serve" | grep -v grep | awk '{print $1}'); do renice -n $EN -p $e >/dev/null; done
renice -n $RN -p $R > /dev/null
for t in $(ls /proc/$R/task); do renice -n $RN -p $t >/dev/null 2>&1; done
for e in $(ps -eo pid,args | grep "rlcore.serve" | grep -v grep | awk '{print $1}'); do for t in $(ls /proc/$e/task); do renice -n $EN -p $t >/dev/null 2>&1; done; done
for t in $(ls /proc/$P/task); do renice -n $TN -p $t >/dev/null 2>&1; done
ps -eo pid,ni,args | grep -E "tiny_cpu|rlcore.serve|spawn_main" | grep -v grep | cut -c1-60 > $O/$N.nice
wait $P
head -1 /proc/stat > $O/$N.stat1
