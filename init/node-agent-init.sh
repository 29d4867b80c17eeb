#!/bin/sh
# Install node-agent from its artifact and bootstrap it (user-data; safe to re-run on every boot).
#   node-agent-init.sh URL SHA256 VERSION   (or NODE_AGENT_URL, NODE_AGENT_SHA256, NODE_AGENT_VERSION)
# URL: http(s)://, file:// or a plain path. A verified install of VERSION is reused as it is; on a
# bad checksum or an unreachable source it exits non-zero with one line and changes no install.
# shellcheck disable=SC2015 # `a && b || die` is meant: die when either fails
set -eu
url=${1:-${NODE_AGENT_URL:-}} sum=${2:-${NODE_AGENT_SHA256:-}} ver=${3:-${NODE_AGENT_VERSION:-}}
cfg=${NODE_AGENT_CONFIG:-/var/lib/gardener-node-agent/config.yaml}
tmpd=/var/lib/gardener-node-agent/tmp top=/opt/node-agent
die() { echo "node-agent-init: $*" >&2; exit 1; }
[ -n "$url" ] && [ -n "$sum" ] && [ -n "$ver" ] || die "usage: $0 URL SHA256 VERSION"
case $ver in *[!A-Za-z0-9._+-]* | .*) die "bad version '$ver'" ;; esac
case $sum in *[!0-9a-f]*) die "bad sha256 '$sum'" ;; esac
[ ${#sum} -eq 64 ] || die "bad sha256 '$sum'"
mkdir -p "$tmpd" "$top" && chmod 0700 "$tmpd" || die "cannot create $tmpd or $top"
dir=$top/$ver tmp=$tmpd/artifact.$$ new=$top/.new.$$
trap 'rm -rf "$tmp" "$new"' EXIT
trap 'exit 1' INT TERM HUP
if command -v flock >/dev/null; then exec 9>"$tmpd/init.lock" && flock 9; fi

if [ -f "$dir/.sha256" ]; then
    [ "$(cat "$dir/.sha256")" = "$sum" ] || die "$dir holds another build of $ver; not replacing it"
    [ -x "$dir/bin/node-agent" ] || die "$dir is damaged (no bin/node-agent); remove it"
else
    [ ! -e "$dir" ] || die "$dir exists but is not a verified install"
    case $url in
    http://* | https://*)
        if command -v curl >/dev/null; then
            err=$(curl -fsS --connect-timeout 10 --max-time 600 --retry "${NODE_AGENT_RETRIES:-3}" \
                -o "$tmp" "$url" 2>&1) || die "cannot fetch $url: $(echo "$err" | tail -n1)"
        else
            err=$(wget -q -T 10 -t "$((${NODE_AGENT_RETRIES:-3} + 1))" -O "$tmp" "$url" 2>&1) ||
                die "cannot fetch $url: ${err:-wget failed}"
        fi ;;
    *) src=${url#file://}
        cp "$src" "$tmp" 2>/dev/null || die "cannot read $src" ;;
    esac
    got=$(sha256sum "$tmp" | cut -d' ' -f1)
    [ "$got" = "$sum" ] || die "checksum mismatch for $url: expected $sum, got $got"
    mkdir "$new" && tar -xzf "$tmp" -C "$new" 2>/dev/null || die "cannot unpack $url into $top"
    [ -x "$new/bin/node-agent" ] && [ "$(cat "$new/VERSION" 2>/dev/null)" = "$ver" ] ||
        die "$url is not a node-agent $ver artifact"
    echo "$sum" >"$new/.sha256"
    mv -T "$new" "$dir"
fi
if [ "$(readlink "$top/current" || true)" != "$ver" ]; then
    ln -sfn "$ver" "$top/.current.$$" && mv -T "$top/.current.$$" "$top/current"
fi
rm -f "$tmp" # exec skips the EXIT trap
exec "$top/current/bin/node-agent" bootstrap --config "$cfg"
