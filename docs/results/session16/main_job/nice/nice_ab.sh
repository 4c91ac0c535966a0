O=/tmp/nice1
/tmp/nicerun.sh $O base1 0 0 0
/tmp/nicerun.sh $O eng5_1 5 0 0
/tmp/nicerun.sh $O tr_m5_1 0 0 -5
/tmp/nicerun.sh $O base2 0 0 0
/tmp/nicerun.sh $O eng5_2 5 0 0
/tmp/nicerun.sh $O tr_m5_2 0 0 -5
