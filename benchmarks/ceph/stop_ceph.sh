#!/usr/bin/env bash
# Stop what start_ceph.sh started (by the pid files in its run dir) and remove its directory.
set -uo pipefail
DIR=${CEPH_DIR:-/tmp/s3ckpt-ceph}
[ -d "$DIR/run" ] || { rm -rf "$DIR"; exit 0; }
pids=()
for pidfile in "$DIR"/run/*.pid; do
  [ -f "$pidfile" ] && pids+=("$(cat "$pidfile")")
done
for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
for _ in $(seq 40); do
  alive=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ "$alive" = 0 ] && break
  sleep 0.25
done
for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
rm -rf "$DIR"
echo "stop_ceph: stopped ${#pids[@]} daemon(s), removed $DIR" >&2
