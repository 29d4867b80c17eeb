#!/bin/sh
# Builds the bed's worker machine image, or reuses it from the cache: Debian bookworm from
# Debian's packages (mmdebstrap), with the cloud kernel, systemd, cloud-init (NoCloud), containerd
# and Debian's CNI plugins, as an ext4 file system image plus the kernel and initrd to boot it
# with (QEMU's direct kernel boot). Output: the directory holding disk.raw, vmlinuz and
# initrd.img (printed on stdout, last line), vm-image-<key> in the cache, keyed by this script
# (which holds the package list and everything written into the image).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
cache=${NODE_AGENT_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/node-agent-test}
packages=linux-image-cloud-amd64,systemd,systemd-sysv,udev,dbus,kmod,cloud-init,containerd
packages=$packages,ca-certificates,iproute2,iptables,e2fsprogs,netbase,logrotate
packages=$packages,containernetworking-plugins
# sshd, as on Gardener's worker images: Gardener's sshd-ensurer.service keeps it enabled and
# running; on a machine without it, that unit fails and restarts every 5 s, each time with a
# reload of systemd (seconds of emulated CPU each).
packages=$packages,openssh-server
key=$(sha256sum "$here/build-image.sh" | cut -c1-16)
out="$cache/vm-image-$key"

cached() {
    for f in disk.raw vmlinuz initrd.img; do [ -s "$out/$f" ] || return 1; done
}

if cached; then
    echo "$out"
    exit 0
fi
for tool in mmdebstrap mkfs.ext4; do
    command -v "$tool" >/dev/null 2>&1 || { echo "build-image: $tool is required" >&2; exit 1; }
done
mkdir -p "$cache"
exec 9>"$cache/.vm-image-$key.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi
if cached; then
    echo "$out"
    exit 0
fi

echo "build-image: building the worker machine image into $out (about two minutes)" >&2
rm -rf "$out.tmp"
mkdir -p "$out.tmp"
root="$out.tmp/root"
# shellcheck disable=SC2016 # the hook's $1 is mmdebstrap's (the root directory)
mmdebstrap --variant=minbase --components=main --include="$packages" \
    --customize-hook='chroot "$1" systemctl enable systemd-networkd.service' \
    bookworm "$root" >&2

# What the machine image brings beyond its packages: its root file system by label, cloud-init
# reading a NoCloud seed only (its network configuration is rendered for systemd-networkd,
# enabled above), and a pod network (a Gardener node's comes from the network
# extension: here Debian's bridge plugin on the VM's own network).
echo 'LABEL=root / ext4 defaults 0 1' > "$root/etc/fstab"
printf 'datasource_list: [ NoCloud, None ]\n' > "$root/etc/cloud/cloud.cfg.d/90-bed.cfg"
# The host keys made when sshd was installed are kept: a VM of the bed lives for one test, and new
# keys would cost its first boot seconds of emulated CPU.
printf 'ssh_deletekeys: false\n' >> "$root/etc/cloud/cloud.cfg.d/90-bed.cfg"
mkdir -p "$root/etc/cni/net.d"
cat > "$root/etc/cni/net.d/10-bed.conflist" <<'CNI'
{"cniVersion": "1.0.0", "name": "bed", "plugins": [{"type": "bridge", "bridge": "cni0",
 "isGateway": true, "ipMasq": true, "ipam": {"type": "host-local", "subnet": "10.244.0.0/24"}}]}
CNI
# The network extension also brings the plugins, to where Gardener's containerd config has the CRI
# look for them (/opt/cni/bin): here Debian's, linked there.
mkdir -p "$root/opt/cni/bin"
for plugin in "$root"/usr/lib/cni/*; do
    ln -s "/usr/lib/cni/${plugin##*/}" "$root/opt/cni/bin/${plugin##*/}"
done
# The machine's journal, every line of it, on its second serial port, which the bed reads from
# the host (the guest has no other way out): which units started when, across reboots.
mkdir -p "$root/etc/systemd/journald.conf.d"
printf '[Journal]\nForwardToConsole=yes\nTTYPath=/dev/ttyS1\nMaxLevelConsole=info\n' \
    > "$root/etc/systemd/journald.conf.d/90-bed.conf"
# The bed's view of the agent's footprint: every 30 s, the proportional set size of the agent's
# whole service (all its processes), as a journal line (bench.vm_node reads it).
mkdir -p "$root/usr/local/sbin" "$root/etc/systemd/system/multi-user.target.wants"
cat > "$root/usr/local/sbin/bed-footprint" <<'SCRIPT'
#!/bin/sh
procs=/sys/fs/cgroup/system.slice/gardener-node-agent.service/cgroup.procs
while sleep 30; do
    pss=0
    for pid in $(cat "$procs" 2>/dev/null); do
        kib=$(awk '/^Pss:/ {print $2}' "/proc/$pid/smaps_rollup" 2>/dev/null)
        pss=$((pss + ${kib:-0}))
    done
    echo "gardener-node-agent.service pss_kib=$pss"
done
SCRIPT
chmod 0755 "$root/usr/local/sbin/bed-footprint"
printf '[Unit]\nDescription=bed footprint probe\n[Service]\nExecStart=/usr/local/sbin/bed-footprint\n[Install]\nWantedBy=multi-user.target\n' \
    > "$root/etc/systemd/system/bed-footprint.service"
ln -s /etc/systemd/system/bed-footprint.service "$root/etc/systemd/system/multi-user.target.wants/bed-footprint.service"
touch "$root/etc/environment"
rm -f "$root/etc/machine-id" "$root/var/lib/dbus/machine-id"
touch "$root/etc/machine-id"

for f in "$root"/boot/vmlinuz-*; do cp "$f" "$out.tmp/vmlinuz"; done
for f in "$root"/boot/initrd.img-*; do cp "$f" "$out.tmp/initrd.img"; done
mkfs.ext4 -q -F -L root -d "$root" "$out.tmp/disk.raw" 4G >&2
rm -rf "$root"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out"
