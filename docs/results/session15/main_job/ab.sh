#!/bin/bash
# alternating 2-minute README runs of two checkouts (replace OLD_CHECKOUT, NEW_CHECKOUT, OUTDIR): old, new, old, new
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then D=OLD_CHECKOUT; else D=NEW_CHECKOUT; fi
    (cd $D && PYTHONPATH=$D python experiments/tiny_cpu.py --minutes 2 --no-progress --log-dir OUTDIR/$v$i > OUTDIR/$v$i.log 2>&1)
  done
done
