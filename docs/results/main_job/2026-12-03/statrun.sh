#!/bin/bash
# The README main job for MINUTES, plus the whole machine's /proc/stat (busy / idle / steal in cores of 2).
# usage: statrun.sh MINUTES OUTDIR [extra args]   (OUTDIR absolute)
MIN=$1; OUT=$2; shift 2; mkdir -p $OUT
cd "$(dirname "$0")/../../../.."   # the repository root
head -1 /proc/stat > $OUT/stat0
python experiments/tiny_cpu.py --minutes $MIN --no-progress --log-dir $OUT/tb "$@" > $OUT/run.log 2>&1 &
P=$!
sleep 30; head -1 /proc/stat > $OUT/stat_a
wait $P
head -1 /proc/stat > $OUT/stat1
python - $OUT <<'PY'
import sys
out=sys.argv[1]
def r(f):
    v=list(map(int,open(f).read().split()[1:]))
    return v
a=r(out+'/stat_a'); b=r(out+'/stat1')
names=['user','nice','system','idle','iowait','irq','softirq','steal','guest','guest_nice']
d=[y-x for x,y in zip(a,b)]
tot=sum(d[:8])
print({n:round(2*v/tot,3) for n,v in zip(names,d)})
PY
