#!/bin/bash
# Loops ib_send_lat -e with both sides virtualized, to catch lost completion
# events (a hang once in ~15 runs under CPU load before real CQs were grown
# for event notifications; docs/vqp.md, Limits):
#   scripts/vm-run.sh target/hang/o env HOG=1 SNAP=target/release bash scripts/repro-events-hang.sh 40
# N pairs of ib_send_lat -e, both virtualized (HOG busy loops beside them in
# the VM, LOGLVL the KRCORE_LOG level); a pair still running after 40 s is a
# hang: gdb stacks of both go to $KRCORE_VM_OUT/hang-<i>.txt.
set -u
cd "$(dirname "$0")/.."
O=$KRCORE_VM_OUT
bash scripts/rxe-up.sh 3 >/dev/null
${SNAP:-target/release}/krcore-meta --listen 10.77.0.1:18790 >$O/meta.txt 2>&1 &
for i in $(seq 100); do grep -q "serving on" $O/meta.txt && break; sleep 0.1; done
export KRCORE_META=10.77.0.1:18790 KRCORE_VIRTUALIZE=${VIRT:-1} KRCORE_LOG=${LOGLVL:-warn}
L=$PWD/${SNAP:-target/release}/libkrcore.so
T=${TOOL:-ib_send_lat}
hangs=0
[ -n "${HOG:-}" ] && { for h in $(seq $HOG); do (while :; do :; done) & done; }
for it in $(seq $1); do
  port=$((18801 + it % 50))
  a="$T -e ${EXTRA:-} -n 1000 -s 2 -d rxe0 -p $port -F"
  KRCORE_GID_INDEX=1 LD_PRELOAD=$L stdbuf -oL $a -x 1 >$O/srv.txt 2>&1 &
  sp=$!
  for i in $(seq 300); do ss -Hltn | grep -q ":$port " && break; sleep 0.1; done
  KRCORE_GID_INDEX=2 LD_PRELOAD=$L stdbuf -oL $a -x 2 10.77.0.1 >$O/cli.txt 2>&1 &
  cp=$!
  ok=0
  for i in $(seq 400); do
    if ! kill -0 $cp 2>/dev/null && ! kill -0 $sp 2>/dev/null; then ok=1; break; fi
    sleep 0.1
  done
  if [ $ok = 0 ]; then
    hangs=$((hangs+1))
    echo "iteration $it: HANG"
    for p in $sp $cp; do
      echo "=== pid $p"; gdb -p $p -batch -ex "thread apply all bt" 2>&1 | grep -E "^#|^Thread" | cut -c1-200
    done > $O/hang-$it.txt
    cp $O/srv.txt $O/srv-$it.txt; cp $O/cli.txt $O/cli-$it.txt
    kill -9 $sp $cp 2>/dev/null
  fi
  wait $sp; s=$?; wait $cp; c=$?
  [ $ok = 1 ] && { [ $s = 0 ] && [ $c = 0 ] || { echo "iteration $it: rc $s/$c"; cp $O/srv.txt $O/srv-$it.txt; cp $O/cli.txt $O/cli-$it.txt; }; }
done
echo "done: $1 iterations, $hangs hangs"
pkill -f krcore-meta; kill $(jobs -p) 2>/dev/null
