#!/usr/bin/env bash
# A development CA and certificates for running pagedkv with mutual TLS
# (docker-compose.mtls.yml, the integration tests, your own hosts for a try-out).
#
#   scripts/gen-dev-certs.sh [DIR]                 # default DIR: certs/dev (git-ignored)
#   PAGEDKV_DEV_NODES="node-0 node-1 node-2" scripts/gen-dev-certs.sh /tmp/certs
#
# Writes into DIR (keys mode 600; an existing DIR's files are replaced):
#   ca.pem ca-key.pem                    the development CA (EC P-256, 30 days by default)
#   block-manager.pem / -key.pem         server + client; DNS block-manager, localhost, IP 127.0.0.1
#   compute-node-N.pem / -key.pem        per node id "node-N" in $PAGEDKV_DEV_NODES: server + client;
#                                        DNS compute-node-N, localhost, IP 127.0.0.1,
#                                        URI spiffe://pagedkv/node/node-N  (the node's identity)
#   scheduler.pem / -key.pem             client; URI spiffe://pagedkv/scheduler  (any scheduler id)
#   admin.pem / -key.pem                 client; URI spiffe://pagedkv/admin
#   subscriber.pem / -key.pem            client; URI spiffe://pagedkv/subscriber  (KV events only)
#
# Identities follow the services' default mapping (auth.cert_uri_prefix = spiffe://pagedkv/):
# a URI SAN spiffe://pagedkv/<role>[/<name>] is principal <role>[:<name>]. Development only:
# the CA key sits next to the certificates. Never commit the output (certs/ is ignored).
# Environment: PAGEDKV_DEV_NODES (default "node-0 node-1"), PAGEDKV_DEV_CERT_DAYS (default 30),
# PAGEDKV_DEV_CA_NAME (the CA's common name; default "pagedkv development CA").
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-certs/dev}
nodes=${PAGEDKV_DEV_NODES:-node-0 node-1}
days=${PAGEDKV_DEV_CERT_DAYS:-30}
ca_name=${PAGEDKV_DEV_CA_NAME:-pagedkv development CA}
command -v openssl >/dev/null || { echo "gen-dev-certs: openssl is required" >&2; exit 2; }
mkdir -p "$out"
umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 -sha256 -days "$days" \
  -subj "/O=pagedkv/CN=$ca_name" -keyout "$out/ca-key.pem" -out "$out/ca.pem" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

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

leaf block-manager serverAuth,clientAuth \
  "DNS:block-manager,DNS:localhost,IP:127.0.0.1,URI:spiffe://pagedkv/block-manager"
for node in $nodes; do
  service="compute-node-${node#node-}"
  leaf "$service" serverAuth,clientAuth "DNS:$service,DNS:localhost,IP:127.0.0.1,URI:spiffe://pagedkv/node/$node"
done
leaf scheduler clientAuth "URI:spiffe://pagedkv/scheduler"
leaf admin clientAuth "URI:spiffe://pagedkv/admin"
leaf subscriber clientAuth "URI:spiffe://pagedkv/subscriber"
chmod 644 "$out"/*.pem
chmod 600 "$out"/*-key.pem
echo "gen-dev-certs: wrote a development CA and certificates for block-manager, ${nodes// /, }, scheduler, admin, subscriber to $out" >&2
