#!/usr/bin/env bash
# Certificates for the Kubernetes manifests (mutual TLS between every pagedkv pod) and the
# Secrets that hold them (docs/kubernetes.md "Certificates").
#
#   deploy/kubernetes/gen-certs.sh [DIR]            # default DIR: certs/k8s (git-ignored; relative to the repo root)
#   kubectl apply -f DIR/tls-secrets.yaml
#
# The names follow the manifests:
#   pagedkv-ca            ca.crt                       the CA every pod trusts
#   block-manager-tls     tls.crt tls.key              DNS block-manager[.NS[.svc[.DOMAIN]]], localhost,
#                                                      IP 127.0.0.1 (the probe), URI spiffe://pagedkv/block-manager
#   api-server-tls        tls.crt tls.key              client: URI spiffe://pagedkv/scheduler
#   router-tls            tls.crt tls.key              client: URI spiffe://pagedkv/scheduler/router (Route only in practice)
#   compute-node-cpu-tls  compute-node-cpu-N.crt/.key  one pair per StatefulSet ordinal N: the node id is the
#   compute-node-gpu-tls  compute-node-gpu-N.crt/.key  pod name, so URI spiffe://pagedkv/node/compute-node-cpu-N;
#                                                      DNS compute-node-cpu-N.compute-node-cpu[.NS[.svc[.DOMAIN]]]
#                                                      (the address the node advertises), localhost, IP 127.0.0.1
#   admin.pem / admin-key.pem (files only, not a Secret): URI spiffe://pagedkv/admin, for your own CLI.
#
# Environment: PAGEDKV_K8S_CPU_NODES / PAGEDKV_K8S_GPU_NODES (ordinals to cover; default 4 / 2:
# scaling a StatefulSet past them needs a re-run), PAGEDKV_K8S_NAMESPACE (pagedkv),
# PAGEDKV_K8S_CLUSTER_DOMAIN (cluster.local), PAGEDKV_K8S_CERT_DAYS (90).
# PAGEDKV_K8S_CA_DIR: reuse the CA (ca.pem + ca-key.pem) in that directory instead of making a
# new one (rotating leaves, adding ordinals). The CA key stays in DIR: keep it out of the cluster.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-certs/k8s}
cpu_nodes=${PAGEDKV_K8S_CPU_NODES:-4}
gpu_nodes=${PAGEDKV_K8S_GPU_NODES:-2}
ns=${PAGEDKV_K8S_NAMESPACE:-pagedkv}
domain=${PAGEDKV_K8S_CLUSTER_DOMAIN:-cluster.local}
days=${PAGEDKV_K8S_CERT_DAYS:-90}
command -v openssl >/dev/null || { echo "gen-certs: openssl is required" >&2; exit 2; }
mkdir -p "$out"
umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [[ -n ${PAGEDKV_K8S_CA_DIR:-} ]]; then
  [[ $PAGEDKV_K8S_CA_DIR -ef $out ]] || cp "$PAGEDKV_K8S_CA_DIR/ca.pem" "$PAGEDKV_K8S_CA_DIR/ca-key.pem" "$out/"
else
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 -days "$days" \
    -subj "/O=pagedkv/CN=pagedkv cluster CA" -keyout "$out/ca-key.pem" -out "$out/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

# leaf NAME EKU SAN: NAME.pem / NAME-key.pem signed by the CA
leaf() {
  local name=$1 eku=$2 san=$3
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 \
    -subj "/O=pagedkv/CN=$name" -keyout "$out/$name-key.pem" -out "$tmp/$name.csr" 2>/dev/null
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n'\
'extendedKeyUsage=%s\nsubjectAltName=%s\n' "$eku" "$san" >"$tmp/$name.ext"
  openssl x509 -req -in "$tmp/$name.csr" -CA "$out/ca.pem" -CAkey "$out/ca-key.pem" -CAcreateserial \
    -CAserial "$tmp/ca.srl" -days "$days" -sha256 -extfile "$tmp/$name.ext" -out "$out/$name.pem" 2>/dev/null
}
# dns NAME: NAME, NAME.NS, NAME.NS.svc, NAME.NS.svc.DOMAIN as SAN entries
dns() { echo "DNS:$1,DNS:$1.$ns,DNS:$1.$ns.svc,DNS:$1.$ns.svc.$domain"; }

leaf block-manager serverAuth,clientAuth \
  "$(dns block-manager),DNS:localhost,IP:127.0.0.1,URI:spiffe://pagedkv/block-manager"
leaf api-server clientAuth "URI:spiffe://pagedkv/scheduler"
leaf router clientAuth "URI:spiffe://pagedkv/scheduler/router"
leaf admin clientAuth "URI:spiffe://pagedkv/admin"
nodes() {  # nodes VARIANT COUNT
  local set="compute-node-$1" i
  for ((i = 0; i < $2; i++)); do
    leaf "$set-$i" serverAuth,clientAuth \
      "$(dns "$set-$i.$set"),DNS:localhost,IP:127.0.0.1,URI:spiffe://pagedkv/node/$set-$i"
  done
}
nodes cpu "$cpu_nodes"
nodes gpu "$gpu_nodes"
chmod 644 "$out"/*.pem
chmod 600 "$out"/*-key.pem

# The Secrets (what `kubectl create secret generic --from-file` would write).
b64() { base64 <"$1" | tr -d '\n'; }
secret() {  # secret NAME KEY=FILE...
  printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\ntype: Opaque\ndata:\n' "$1" "$ns"
  shift
  local kv
  for kv in "$@"; do printf '  %s: %s\n' "${kv%%=*}" "$(b64 "${kv#*=}")"; done
}
per_node() {  # per_node VARIANT COUNT: KEY=FILE pairs of every ordinal
  local set="compute-node-$1" i
  for ((i = 0; i < $2; i++)); do echo "$set-$i.crt=$out/$set-$i.pem" "$set-$i.key=$out/$set-$i-key.pem"; done
}
{
  echo "# gen-certs.sh: the pagedkv TLS Secrets (apply with kubectl apply -f; contains private keys)"
  secret pagedkv-ca "ca.crt=$out/ca.pem"
  secret block-manager-tls "tls.crt=$out/block-manager.pem" "tls.key=$out/block-manager-key.pem"
  secret api-server-tls "tls.crt=$out/api-server.pem" "tls.key=$out/api-server-key.pem"
  secret router-tls "tls.crt=$out/router.pem" "tls.key=$out/router-key.pem"
  # shellcheck disable=SC2046
  secret compute-node-cpu-tls $(per_node cpu "$cpu_nodes")
  # shellcheck disable=SC2046
  secret compute-node-gpu-tls $(per_node gpu "$gpu_nodes")
} >"$out/tls-secrets.yaml"
chmod 600 "$out/tls-secrets.yaml"
echo "gen-certs: CA and certificates for block-manager, api-server, router, admin, $cpu_nodes cpu and $gpu_nodes gpu node(s) in $out;" \
  "kubectl apply -f $out/tls-secrets.yaml" >&2
