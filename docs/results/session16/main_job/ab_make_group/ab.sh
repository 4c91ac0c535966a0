#!/bin/bash
# usage: ab.sh OUTDIR PAIRS : alternating 2-minute README runs old (/work/wt-old) and new (/work/main)
O=$1; N=${2:-2}; mkdir -p $O
for i in $(seq 1 $N); do
  for v in old new; do
    if [ $v = old ]; then D=/work/wt-old; else D=/work/main; fi
    head -1 /proc/stat > $O/$v$i.stat0
    (cd $D && PYTHONPATH=$D python experiments/tiny_cpu.py --minutes 2 --no-progress --log-dir $O/tb_$v$i > $O/$v$i.log 2>&1)
    head -1 /proc/stat > $O/$v$i.stat1
  done
done
