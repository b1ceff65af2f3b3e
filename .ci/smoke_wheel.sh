#!/usr/bin/env bash
# Packaging smoke test: build the wheel, install it in a fresh venv as a user would, and drive
# the installed `s3ckpt` command from outside the checkout (so the checkout is not importable):
# --version, serve, a tiny save, ls, stop with Ctrl-C. Runs alone: .ci/smoke_wheel.sh
# PYTHON and TORCH_PIP_ARGS (e.g. --index-url https://download.pytorch.org/whl/cpu) as in make.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKOUT="$PWD"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
read -r -a TORCH_ARGS <<<"${TORCH_PIP_ARGS:-}"

WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

step() { echo "--- smoke: $* ($SECONDS s)"; }

# pip builds the wheel through the PEP 517 backend in pyproject.toml, exactly what
# `python -m build` would do, without adding `build` as a dependency of CI. It builds from a
# copy of the files git knows (ignored ones left out): setuptools reuses a `build/` directory in
# the source tree, which would ship modules deleted since the last build.
step "building the wheel"
mkdir "$WORK/src"
git ls-files --cached --others --exclude-standard -z |
    tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$WORK/src"
"$PYTHON" -m pip wheel --no-deps --quiet -w "$WORK/dist" "$WORK/src"
WHEELS=("$WORK"/dist/s3ckpt-*.whl)
WHEEL="${WHEELS[0]}"
echo "built $(basename "$WHEEL")"

step "installing it in a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# torch first and pinned, as in the README; boto3 and botocore are left to aiobotocore's pin.
"$VPY" -m pip install --quiet "${TORCH_ARGS[@]}" "torch==$TORCH_VERSION"
"$VPY" -m pip install --quiet "s3ckpt[local] @ file://$WHEEL"
"$VPY" -m pip check
S3CKPT="$WORK/venv/bin/s3ckpt"

mkdir "$WORK/cwd"
cd "$WORK/cwd"
step "running the installed CLI from $PWD"
"$VPY" - "$CHECKOUT" <<'EOF'
import sys
from pathlib import Path

import s3ckpt

where = Path(s3ckpt.__file__).resolve()
assert Path(sys.argv[1]).resolve() not in where.parents, f"imported from the checkout: {where}"
assert "site-packages" in where.parts, where
EOF
"$S3CKPT" --version

# A port p with p + 10000 free as well: SeaweedFS serves gRPC there.
PORT="$("$VPY" -c '
import random, socket
def free(p):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            return False
    return True
print(next(p for p in iter(lambda: random.randrange(12000, 22000), None) if free(p) and free(p + 10000)))
')"
# Job control on: otherwise bash starts a background job with SIGINT ignored.
set -m
"$S3CKPT" serve --dir "$WORK/data" --port "$PORT" --bucket smoke --json \
    >"$WORK/serve.out" 2>"$WORK/serve.err" &
SERVER_PID=$!
set +m
for _ in $(seq 240); do
    [[ -s "$WORK/serve.out" ]] && break
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        cat "$WORK/serve.err" >&2
        echo "smoke: s3ckpt serve exited before it was ready" >&2
        exit 1
    fi
    sleep 0.5
done
if [[ ! -s "$WORK/serve.out" ]]; then
    tail -c 4000 "$WORK/serve.err" >&2
    echo "smoke: s3ckpt serve printed nothing in 120 s" >&2
    exit 1
fi
# The printed settings, as `export` lines for this shell (values are shell-quoted).
eval "$("$VPY" -c '
import json, shlex, sys
settings = json.loads(open(sys.argv[1]).readline())
for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
    print(f"export {name}={shlex.quote(settings[name])}")
assert settings["bucket"] == "smoke", settings
' "$WORK/serve.out")"
echo "serving at $AWS_ENDPOINT_URL"

step "a tiny save through the installed package"
"$VPY" -c '
import torch
import torch.distributed.checkpoint as dcp
from s3ckpt import S3Reader, S3Writer

state = {"w": torch.arange(8.0)}
dcp.save(state, checkpoint_id="s3://smoke/run/step-1", storage_writer=S3Writer("smoke"))
loaded = {"w": torch.zeros(8)}
dcp.load(loaded, storage_reader=S3Reader("s3://smoke/run/step-1"))
assert torch.equal(loaded["w"], state["w"])
'
step "s3ckpt ls"
"$S3CKPT" ls s3://smoke | tee "$WORK/ls.out"
grep -q "step-1" "$WORK/ls.out"

step "stopping the server with SIGINT"
kill -INT "$SERVER_PID"
STATUS=0
wait "$SERVER_PID" || STATUS=$?
SERVER_PID=""
if [[ "$STATUS" -ne 0 ]]; then
    tail -c 4000 "$WORK/serve.err" >&2
    echo "smoke: s3ckpt serve exited $STATUS after SIGINT" >&2
    exit 1
fi
step "passed"
