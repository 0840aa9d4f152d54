#!/usr/bin/env bash
# What TLS with client certificates costs per etcd request: one etcd serving plain http and
# https with --client-cert-auth on two ports (same process, same data), and
# benches/etcd_txn.rs run against each port in turn, ROUNDS times, at concurrency 1 and 16.
# Prints the median ops/s and p50 per request kind.
#
# usage: benches/etcd_tls.sh [ROUNDS] [PORT]   (PORT, PORT+1, PORT+2 must be free; default 28402)
# Needs etcd and openssl (bench only: etcfs itself makes certificates with rcgen).
set -euo pipefail
ROUNDS=${1:-3}
PORT=${2:-28402}
cd "$(dirname "$0")/.."
for tool in etcd etcdctl openssl python3; do
    command -v "$tool" >/dev/null || { echo "etcd_tls.sh needs $tool" >&2; exit 1; }
done
dir=$(mktemp -d /tmp/etcfs-etcd-tls.XXXXXX)
etcd_pid=
cleanup() {
    [[ -n $etcd_pid ]] && kill "$etcd_pid" 2>/dev/null && wait "$etcd_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

cat >"$dir/ext.cnf" <<'EOF'
[srv]
subjectAltName=IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth
[cli]
extendedKeyUsage=clientAuth
EOF
(
    cd "$dir"
    openssl ecparam -name prime256v1 -genkey -noout -out ca.key
    openssl req -x509 -new -key ca.key -subj /CN=bench-ca -days 2 -out ca.crt
    for n in srv cli; do
        openssl ecparam -name prime256v1 -genkey -noout -out $n.ec
        openssl pkcs8 -topk8 -nocrypt -in $n.ec -out $n.key
        openssl req -new -key $n.key -subj /CN=$n -out $n.csr
        openssl x509 -req -in $n.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
            -extfile ext.cnf -extensions $n -out $n.crt
    done
) >/dev/null 2>&1

http=http://127.0.0.1:$PORT
https=https://127.0.0.1:$((PORT + 2))
peer=http://127.0.0.1:$((PORT + 1))
etcd --name tls --data-dir "$dir/data" --listen-client-urls "$http,$https" \
    --advertise-client-urls "$http" --listen-peer-urls "$peer" \
    --initial-advertise-peer-urls "$peer" --initial-cluster "tls=$peer" \
    --client-cert-auth --trusted-ca-file "$dir/ca.crt" \
    --cert-file "$dir/srv.crt" --key-file "$dir/srv.key" >"$dir/etcd.log" 2>&1 &
etcd_pid=$!
for _ in $(seq 100); do
    etcdctl --endpoints "$http" endpoint health >/dev/null 2>&1 && break
    sleep 0.1
done

cargo build --release --bench etcd_txn >/dev/null 2>&1
bin=$(cargo bench --bench etcd_txn --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*etcd_txn[^"]*\)".*/\1/p' | tail -1)

results="$dir/results"
for r in $(seq "$ROUNDS"); do
    for mode in plain tls; do
        if [[ $mode == plain ]]; then
            args=(--etcd "$http")
        else
            args=(--etcd "$https" --etcd-cacert "$dir/ca.crt" --etcd-cert "$dir/cli.crt"
                --etcd-key "$dir/cli.key")
        fi
        for c in 1 16; do
            "$bin" "${args[@]}" --prefix "bench-$mode-$r-$c" --ops 2000 --concurrency "$c" |
                sed "s/^/mode=$mode /" >>"$results"
        done
    done
done

python3 - "$results" "$ROUNDS" <<'EOF'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    kv = dict(f.split("=", 1) for f in line.split())
    key = (kv["kind"], kv["concurrency"], kv["mode"])
    rows.setdefault(key, []).append((float(kv["ops_per_s"]), float(kv["p50_us"])))
print(f"medians of {sys.argv[2]} rounds, 2000 requests each")
print(f"{'kind':8} {'conc':>4} {'plain ops/s':>12} {'tls ops/s':>10} {'plain p50 us':>13} {'tls p50 us':>11}")
for kind in ["create", "get", "unlink"]:
    for c in ["1", "16"]:
        p, t = rows[(kind, c, "plain")], rows[(kind, c, "tls")]
        med = lambda v, i: statistics.median(x[i] for x in v)
        print(f"{kind:8} {c:>4} {med(p,0):12.0f} {med(t,0):10.0f} {med(p,1):13.0f} {med(t,1):11.0f}")
EOF
