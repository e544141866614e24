#!/bin/sh
# OpenDsec guest init: PID 1 of the initramfs (busybox sh). It loads the modules in
# dependency order, finds the disks by their serial numbers, mounts the root, puts the
# agent and its configuration on a private tmpfs at /.opendsec, configures the agent
# channel (eth0; its default route goes to the tap's host side, where the edge gives a
# link out or none) and execs the agent as PID 1 of the guest.
# Two machines (/opendsec/machine says which this initramfs is for):
# - microvm: the kernel and this initramfs (with the VM's configuration appended) come
#   from QEMU; the root is the read-only image disk (EROFS) under a writable ext4 disk,
#   composed with overlayfs.
# - q35: SeaBIOS and extlinux loaded this initramfs from the VM's own disk; the root is
#   that disk's ext4 partition (root= on the command line), mounted read-write; the VM's
#   configuration is a cpio archive on a small read-only disk of its own.
# Any failure ends init: the kernel panics, `panic=-1` reboots, QEMU (-no-reboot) exits,
# and the edge sees the VM exit with this output in console.log.
PATH=/bin
export PATH

die() {
    echo "opendsec-init: FAILED: $*"
    echo "@@OPENDSEC_INIT_FAILED"
    exit 1
}

mount -t devtmpfs dev /dev || die "mounting devtmpfs"
mount -t proc proc /proc || die "mounting /proc"
mount -t sysfs sys /sys || die "mounting /sys"

# The accelerator probe only needs to know that user space was reached.
case " $(cat /proc/cmdline) " in
*" opendsec.probe=1 "*)
    echo "@@OPENDSEC_PROBE_USERSPACE"
    reboot -f
    ;;
esac

while read -r module; do
    insmod "/lib/modules/$module.ko" || die "insmod $module"
done </lib/modules/load-order

machine=microvm
[ -r /opendsec/machine ] && machine=$(cat /opendsec/machine)

# The block device whose virtio serial number is $1 (waits for it to appear).
disk_with_serial() {
    tries=0
    while :; do
        for dev in /sys/block/vd*; do
            if [ -r "$dev/serial" ] && [ "$(cat "$dev/serial")" = "$1" ]; then
                echo "/dev/${dev##*/}"
                return 0
            fi
        done
        tries=$((tries + 1))
        [ "$tries" -gt 1000 ] && return 1
        usleep 10000
    done
}

if [ "$machine" = q35 ]; then
    echo "opendsec-init: q35, booted with: $(cat /proc/cmdline)"
    config_dev=$(disk_with_serial opendsec-config) || die "the configuration disk is missing"
    (cd / && cpio -i -d -m <"$config_dev" 2>/dev/null) || die "unpacking the configuration from $config_dev"
    . /opendsec/vm.conf
    root=
    for word in $(cat /proc/cmdline); do
        case "$word" in
        root=*) root=${word#root=} ;;
        esac
    done
    [ -n "$root" ] || die "no root= on the kernel command line"
    tries=0
    until root_dev=$(findfs "$root" 2>/dev/null); do
        tries=$((tries + 1))
        [ "$tries" -gt 1000 ] && die "the root $root was not found"
        usleep 10000
    done
    # The host may give the disk more room than the image's file system has: the
    # partition and then the mounted file system grow to fill it (best effort).
    /opendsec/agent grow-partition "$root_dev" || echo "opendsec-init: the root partition keeps its size"
    # Re-reading the partition table re-creates the partition's device node.
    tries=0
    until [ -b "$root_dev" ]; do
        tries=$((tries + 1))
        [ "$tries" -gt 1000 ] && die "$root_dev did not come back after growing"
        usleep 10000
    done
    mount -t ext4 -o rw,noatime "$root_dev" /newroot || die "mounting the root $root_dev"
    /opendsec/agent grow-fs /newroot "$root_dev" || echo "opendsec-init: the root file system keeps its size"
else
    . /opendsec/vm.conf

    # Device names follow probe order; the serial numbers QEMU gives the disks do not.
    # Firecracker's serials are its own (device and inode numbers): there the read-only
    # disk is the image and the writable one is ours.
    root_dev=
    rw_dev=
    tries=0
    while :; do
        for dev in /sys/block/vd*; do
            [ -r "$dev/serial" ] || continue
            case "$(cat "$dev/serial")" in
            opendsec-root) root_dev=/dev/${dev##*/} ;;
            opendsec-rw) rw_dev=/dev/${dev##*/} ;;
            *)
                if [ "$(cat "$dev/ro" 2>/dev/null)" = 1 ]; then
                    root_dev=/dev/${dev##*/}
                else
                    rw_dev=/dev/${dev##*/}
                fi
                ;;
            esac
        done
        [ -n "$root_dev" ] && [ -n "$rw_dev" ] && break
        tries=$((tries + 1))
        [ "$tries" -gt 1000 ] && die "disks not found (root: '$root_dev', writable: '$rw_dev')"
        usleep 10000
    done

    mount -t erofs -o ro "$root_dev" /ro || die "mounting the image disk $root_dev"
    mount -t ext4 -o noatime "$rw_dev" /rw || die "mounting the writable disk $rw_dev"
    mkdir -p /rw/upper /rw/work || die "preparing the writable disk"
    mount -t overlay overlay -o lowerdir=/ro,upperdir=/rw/upper,workdir=/rw/work /newroot ||
        die "mounting the overlay root"
fi

# The agent and its configuration: root-only, read-only, gone with the guest.
mkdir -p /newroot/.opendsec || die "creating /.opendsec"
mount -t tmpfs -o mode=0700,size=64m opendsec /newroot/.opendsec || die "mounting /.opendsec"
mkdir /newroot/.opendsec/config || die "creating /.opendsec/config"
cp /opendsec/agent /newroot/.opendsec/agent || die "copying the agent"
cp /opendsec/config/* /newroot/.opendsec/config/ || die "copying the agent's configuration"
chmod 0600 /newroot/.opendsec/config/*
mount -o remount,ro /newroot/.opendsec || die "making /.opendsec read-only"

for dir in dev proc sys run tmp; do
    mkdir -p "/newroot/$dir"
done
mount --move /dev /newroot/dev || die "moving /dev"
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o gid=5,mode=0620,ptmxmode=0666 devpts /newroot/dev/pts || die "mounting devpts"
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm || die "mounting /dev/shm"
mount --move /proc /newroot/proc || die "moving /proc"
mount --move /sys /newroot/sys || die "moving /sys"
mount -t tmpfs -o mode=0755 run /newroot/run || die "mounting /run"

# The agent channel: this guest's side of the tap's /30. Everything else goes to the
# tap's host side too, where the edge gives the sandbox a link out under its policy (or
# none), and names are asked there (the edge sends them to its DNS proxy).
ip link set lo up || die "lo up"
ip addr add "$GUEST_IP/$GUEST_PREFIX" dev eth0 || die "addressing eth0"
ip link set eth0 up || die "eth0 up"
ip route add default via "$HOST_IP" dev eth0 || die "the default route"
if ! { rm -f /newroot/etc/resolv.conf && echo "nameserver $HOST_IP" > /newroot/etc/resolv.conf; }; then
    echo "opendsec-init: cannot write /etc/resolv.conf: names do not resolve" >&2
fi
hostname "$GUEST_HOSTNAME"

set -- serve --listen "tcp:$GUEST_IP:$AGENT_PORT" \
    --access-token-file /.opendsec/config/token \
    --env-file /.opendsec/config/env.json
if [ -f /opendsec/config/start.json ]; then
    set -- "$@" --start-file /.opendsec/config/start.json
fi
if [ -f /opendsec/config/workdir ]; then
    set -- "$@" --workdir-file /.opendsec/config/workdir
fi
if [ -f /opendsec/config/user ]; then
    set -- "$@" --user-file /.opendsec/config/user
fi
echo "@@OPENDSEC_AGENT_EXEC"
exec switch_root /newroot /.opendsec/agent "$@"
