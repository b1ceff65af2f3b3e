#!/usr/bin/env bash
# Single-node Ceph RGW on 127.0.0.1 for the benchmarks: 1 mon, 1 bluestore OSD on a sparse file,
# 1 radosgw (beast), as root and without systemd. Creates an S3 user with fixed keys and prints
#   CEPH_S3_ENDPOINT=http://127.0.0.1:PORT  CEPH_S3_ACCESS_KEY=...  CEPH_S3_SECRET_KEY=...
# on stdout (progress goes to stderr). Running it again while the gateway answers only re-prints.
#
# Needs: apt-get install -y radosgw ceph-mon ceph-osd ceph-common   (Debian 12: Ceph 16.2)
# Settings (environment): CEPH_DIR (/tmp/s3ckpt-ceph), CEPH_RGW_PORT (7480),
#   CEPH_OSD_SIZE_GIB (40, sparse), CEPH_ACCESS_KEY, CEPH_SECRET_KEY. Stop with stop_ceph.sh.
set -euo pipefail

DIR=${CEPH_DIR:-/tmp/s3ckpt-ceph}
PORT=${CEPH_RGW_PORT:-7480}
SIZE_GIB=${CEPH_OSD_SIZE_GIB:-40}
ACCESS_KEY=${CEPH_ACCESS_KEY:-s3ckpt-ceph}
SECRET_KEY=${CEPH_SECRET_KEY:-s3ckpt-ceph-secret-key}
CONF="$DIR/ceph.conf"
CEPH=(ceph -c "$CONF" --connect-timeout 20)

say() { echo "start_ceph: $*" >&2; }
answers() { curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$PORT/"; }
wait_for() { # wait_for SECONDS WHAT COMMAND...
  local limit=$1 what=$2
  shift 2
  for _ in $(seq "$((limit * 2))"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  say "$what not ready after ${limit}s; logs in $DIR/log"
  tail -n 20 "$DIR"/log/*.log >&2 || true
  exit 1
}
print_endpoint() {
  echo "CEPH_S3_ENDPOINT=http://127.0.0.1:$PORT"
  echo "CEPH_S3_ACCESS_KEY=$ACCESS_KEY"
  echo "CEPH_S3_SECRET_KEY=$SECRET_KEY"
}
ensure_user() {
  if ! radosgw-admin -c "$CONF" user info --uid=s3ckpt >/dev/null 2>&1; then
    radosgw-admin -c "$CONF" user create --uid=s3ckpt --display-name="s3ckpt bench" \
      --access-key="$ACCESS_KEY" --secret="$SECRET_KEY" >/dev/null
  fi
}

[ "$(id -u)" = 0 ] || { say "must run as root"; exit 1; }
for tool in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool uuidgen curl; do
  command -v "$tool" >/dev/null || { say "missing $tool (apt-get install -y radosgw ceph-mon ceph-osd ceph-common)"; exit 1; }
done

if [ -f "$CONF" ] && answers; then
  say "already running at 127.0.0.1:$PORT"
  ensure_user
  print_endpoint
  exit 0
fi
if [ -e "$DIR" ]; then
  say "$DIR exists but the gateway does not answer: stopping and starting afresh"
  "$(dirname "$0")/stop_ceph.sh" >&2
fi

started=$(date +%s)
mkdir -p "$DIR"/{mon,osd,log,run}
FSID=$(uuidgen)
cat >"$CONF" <<CONF
[global]
fsid = $FSID
mon host = v2:127.0.0.1:3300
public addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
run dir = $DIR/run
admin socket = $DIR/run/\$cluster-\$name.asok
pid file = $DIR/run/\$cluster-\$name.pid
log file = $DIR/log/\$cluster-\$name.log
[mon]
mon data = $DIR/mon/\$cluster-\$id
[osd]
osd data = $DIR/osd/\$cluster-\$id
osd objectstore = bluestore
bluestore block path = $DIR/osd/block-\$id
bluestore block create = true
bluestore block size = $((SIZE_GIB * 1024 * 1024 * 1024))
osd memory target = 1610612736
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$PORT
rgw dns name = 127.0.0.1
# reclaim deleted objects within seconds (default: after 2 h), or benchmarks that write and
# delete GiBs per case fill the OSD
rgw gc obj min wait = 5
rgw gc processor period = 5
# with auth none, radosgw otherwise loops forever negotiating with the mon
ms mon client mode = crc secure
CONF

say "mon"
monmaptool --create --addv a "[v2:127.0.0.1:3300]" --fsid "$FSID" "$DIR/monmap" >/dev/null
ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap"
ceph-mon -c "$CONF" -i a
wait_for 30 "mon" "${CEPH[@]}" -s

say "osd"
OSD_UUID=$(uuidgen)
OSD_ID=$("${CEPH[@]}" osd new "$OSD_UUID")
mkdir -p "$DIR/osd/ceph-$OSD_ID"
ceph-osd -c "$CONF" -i "$OSD_ID" --mkfs --osd-uuid "$OSD_UUID" 2>>"$DIR/log/mkfs.log"
ceph-osd -c "$CONF" -i "$OSD_ID"
osd_up() { "${CEPH[@]}" osd stat | grep -q "1 up"; }
wait_for 60 "osd" osd_up

say "rgw"
radosgw -c "$CONF" -n client.rgw.a
wait_for 90 "radosgw" answers
ensure_user
say "ready in $(($(date +%s) - started)) s"
print_endpoint
