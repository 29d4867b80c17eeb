#!/bin/sh
# PID 1 of a fresh set of namespaces (started by tests/testbed/systemd_ns.py through
# `unshare --pid --fork --mount --mount-proc --uts --ipc --cgroup`). It prepares a
# private view of the host for a real systemd, then execs systemd in place.
#
#   systemd-init.sh MODE SCRATCH [UNMASK]
#     MODE     "plain":   host root, with private /run, /tmp, /var/tmp, /etc/systemd/system,
#                         /var/lib/systemd and /var/log/journal
#              "overlay": a throwaway node: an overlay of the host's / with a tmpfs upper
#                         layer becomes the root, so anything may be written anywhere
#     SCRATCH  a host directory used as a mount point for this instance's tmpfs
#     UNMASK   optional, space-separated: distribution units a test wants to run for real
#              (e.g. containerd.service), left out of the masks below
#
# Nothing here may reach the host: the mount namespace is private (no propagation),
# every place systemd or a unit writes to is a tmpfs, and every unit the distribution
# would pull in that touches the host (tmpfiles, sysctl, udev, binfmt, ...) is masked.
set -eu

mode=$1
scratch=$2
unmask=${3:-}
target=node-agent-test.target

# Units systemd must keep: the bus, journald and their sockets.
keep=" dbus.socket dbus.service systemd-journald.service systemd-journald.socket \
systemd-journald-dev-log.socket $target $unmask "

# Units that touch the host or make no sense here, beyond those the distribution wires
# into *.target.wants (collected below).
extra_masks="systemd-tmpfiles-setup.service systemd-tmpfiles-setup-dev.service
systemd-tmpfiles-setup-dev-early.service systemd-tmpfiles-clean.service
systemd-tmpfiles-clean.timer systemd-sysctl.service systemd-binfmt.service
proc-sys-fs-binfmt_misc.automount proc-sys-fs-binfmt_misc.mount systemd-modules-load.service
systemd-udevd.service systemd-udevd-control.socket systemd-udevd-kernel.socket
systemd-udev-trigger.service systemd-udev-settle.service systemd-utmp.service
systemd-update-utmp.service systemd-update-utmp-runlevel.service systemd-journal-flush.service
systemd-timesyncd.service systemd-networkd.service systemd-resolved.service networking.service
systemd-random-seed.service systemd-remount-fs.service systemd-machine-id-commit.service
systemd-firstboot.service systemd-sysusers.service systemd-hwdb-update.service
systemd-journal-catalog-update.service systemd-update-done.service ldconfig.service
systemd-logind.service getty.target console-getty.service systemd-pstore.service
systemd-journald-audit.socket systemd-initctl.socket systemd-initctl.service
tmp.mount dev-hugepages.mount dev-mqueue.mount sys-kernel-config.mount sys-kernel-debug.mount
sys-kernel-tracing.mount sys-fs-fuse-connections.mount kmod-static-nodes.service
systemd-ask-password-console.path systemd-ask-password-wall.path systemd-fsck-root.service
systemd-quotacheck.service systemd-boot-check-no-failures.service cron.service
apt-daily.timer apt-daily-upgrade.timer fstrim.timer e2scrub_all.timer man-db.timer
dpkg-db-backup.timer postgresql.service ssh.service"

# Collect the unit names to mask before /etc/systemd/system is hidden.
masks=$(
    {
        for d in /lib/systemd/system/*.wants /etc/systemd/system/*.wants; do
            [ -d "$d" ] && ls -1 "$d"
        done
        printf '%s\n' $extra_masks
    } | sort -u
)

if [ "$mode" = overlay ]; then
    mount -t tmpfs -o mode=0755 node-root "$scratch"
    mkdir -p "$scratch/upper" "$scratch/work" "$scratch/root"
    mount -t overlay node-root -o "lowerdir=/,upperdir=$scratch/upper,workdir=$scratch/work" \
        "$scratch/root"
    mount --rbind /dev "$scratch/root/dev"
    mount -t proc proc "$scratch/root/proc"
    mount --bind /sys "$scratch/root/sys"
    mkdir -p "$scratch/root/.old-root"
    cd "$scratch/root"
    pivot_root . .old-root
    cd /
    umount -l /.old-root
    rmdir /.old-root
else
    mount -t tmpfs -o mode=1777 tmp /tmp
    mount -t tmpfs -o mode=1777 var-tmp /var/tmp
fi

# Private, writable places for systemd's own state.
mount -t tmpfs -o mode=0755 run /run
mount -t tmpfs -o mode=0755 etc-systemd-system /etc/systemd/system
mount -t tmpfs -o mode=0755 var-lib-systemd /var/lib/systemd
mkdir -p /var/log/journal
mount -t tmpfs -o mode=2755 var-log-journal /var/log/journal

# The kernel's knobs stay read-only; only our own cgroup subtree is writable.
mount --bind /proc/sys /proc/sys
mount -o remount,bind,ro /proc/sys
mount --bind /sys /sys
mount -o remount,bind,ro /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup

mkdir -p /run/systemd/system /run/systemd/journald.conf.d /run/systemd/empty-generators
for unit in $masks; do
    case "$keep" in *" $unit "*) continue ;; esac
    ln -sf /dev/null "/run/systemd/system/$unit"
done
printf '[Journal]\nStorage=volatile\nRuntimeMaxUse=16M\n' \
    > /run/systemd/journald.conf.d/10-test-bed.conf
cat > "/run/systemd/system/$target" <<EOF
[Unit]
Description=node-agent test bed
Wants=dbus.socket systemd-journald.socket
After=dbus.socket systemd-journald.socket
EOF

export container=other
export SYSTEMD_GENERATOR_PATH=/run/systemd/empty-generators
export SYSTEMD_ENVIRONMENT_GENERATOR_PATH=/run/systemd/empty-generators
export SYSTEMD_LOG_TARGET=console
exec /lib/systemd/systemd --system "--unit=$target" --show-status=no
