#!/usr/bin/env bash
# Make the run's TLS certificates with openssl, into TLS_DIR (default ~/.config/diloco_jax/RUN-tls, mode
# 700): a CA (ca.pem, ca.key), the syncer's certificate (syncer.pem, syncer.key) naming its internal IP
# (the address learners dial) and 127.0.0.1 (status.sh asks over loopback), and a learner client
# certificate (learner.pem, learner.key) for mutual TLS: delete those two to have the syncer ask for none.
#
#   launch/tpu/certs.sh [--dry-run]
#
# Run it after create.sh (the syncer VM must exist), then `TLS_DIR=... launch/tpu/start.sh`. The keys never
# leave this machine except to the host that uses each (start.sh copies them with scp, mode 600).
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_common_flags "$@"
((${#ARGS[@]} == 0)) || die "unknown arguments: ${ARGS[*]} (see --help)"
TLS_DIR=${TLS_DIR:-$HOME/.config/diloco_jax/$RUN-tls}
saved_tls_dir=$TLS_DIR
TLS_DIR=""  # check_settings checks an existing TLS_DIR; this script makes it
check_settings
TLS_DIR=$saved_tls_dir
ip=$(syncer_ip)
if ((DRY_RUN)); then
  note "would make a CA and certificates for the syncer (IP $ip, 127.0.0.1) and the learners in $TLS_DIR"
  exit 0
fi
command -v openssl > /dev/null || die "openssl is needed"
mkdir -p "$TLS_DIR"
chmod 700 "$TLS_DIR"
cd "$TLS_DIR"
(
  umask 077
  openssl req -x509 -newkey rsa:3072 -nodes -keyout ca.key -out ca.pem -days 365 -subj "/CN=diloco $RUN CA" 2> /dev/null
  # cert NAME SUBJECT_ALT_NAMES: a key and a certificate signed by the CA.
  cert() {
    openssl req -newkey rsa:3072 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=diloco $RUN $1" 2> /dev/null
    printf 'subjectAltName=%s\n' "$2" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$1.pem" -days 365 \
      -extfile "$1.ext" 2> /dev/null
    rm -f "$1.csr" "$1.ext"
  }
  cert syncer "IP:$ip,IP:127.0.0.1"
  cert learner "DNS:learner.$RUN"
)
note "TLS certificates in $TLS_DIR (syncer: $ip, 127.0.0.1); use them: TLS_DIR=$TLS_DIR launch/tpu/start.sh"
