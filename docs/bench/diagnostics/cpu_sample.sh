#!/bin/bash
# Every 2 s: the cumulative CPU ticks of each process (utime+stime) and the core it last ran on.
while true; do
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    stat=$(cat $d/stat 2>/dev/null) || continue
    rest=${stat##*) }
    set -- $rest
    # fields after comm: state=1 ... utime=12 stime=13 ... processor=37
    args=$(tr '\0' ' ' < $d/cmdline 2>/dev/null | cut -c1-120)
    echo "$(date +%s) $pid ${12} ${13} ${37} $args"
  done
  sleep 2
done
