#!/usr/bin/env bash
# Runs a command as root inside a throwaway QEMU guest that has real soft-RoCE RDMA devices, and exits with its status.
#   bash ci/rxe-guest.sh [--nics N] [--mem MiB] [--timeout SECONDS] [--out DIR] -- CMD [ARGS...]
# Why: this machine's kernel has no RDMA modules (and loads none), but Debian's 6.1 kernel has rdma_rxe. The guest
# boots that kernel under software emulation (TCG; nested KVM does not boot here) with this machine's root file
# system mounted read-only over 9p under a tmpfs overlay: every host path is visible and writable in the guest,
# writes stay there, so CMD runs with the project's venv and checkout as they are. Each NIC i (QEMU user
# networking) is eth<i> with 10.77.<i>.15/24 and an rxe device rxe<i>. CMD runs in the caller's working directory
# with KVPLUGINS_* and PYTHON* variables (and those named in GUEST_ENV, space separated) passed through, plus
# KVPLUGINS_IN_GUEST=1, RXE_HOST_CPU (the host's CPU model, for benchmark records) and RXE_GUEST_OUT, a directory
# shared read-write with the host (--out, default a temporary one, printed at the end when CMD left files there).
# RLIMIT_MEMLOCK is unlimited in the guest. The guest kernel's messages stay off the output (only EMERG/ALERT,
# e.g. a panic, reach it); when CMD fails, the warnings it logged while CMD ran follow CMD's output.
# Everything in the guest runs 10-50x slower than on the host: test correctness there, and compare speed only
# against perftest run in the same guest. Boot takes ~10-15 s.
# Exit: CMD's status; 124 past --timeout (default 1500 s); 125 when the guest never reported one (boot failure);
# 2 for bad usage or a missing package. Needs (Debian 12, ci/install.sh): qemu-system-x86 linux-image-amd64
# busybox-static cpio rdma-core ibverbs-providers libibverbs-dev (perftest for ib_*_bw / ib_read_lat).
set -euo pipefail
NICS=1 MEM=3072 TIMEOUT=1500 OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nics) NICS=$2; shift 2 ;;
    --mem) MEM=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
die() { echo "rxe-guest: $1" >&2; exit "${2:-2}"; }
[ $# -gt 0 ] || die "usage: $0 [--nics N] [--mem MiB] [--timeout S] [--out DIR] -- CMD [ARGS...]"
[[ "$NICS" =~ ^[1-8]$ ]] || die "--nics $NICS: use 1..8"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found: apt-get install qemu-system-x86"
command -v cpio >/dev/null || die "cpio not found: apt-get install cpio"
[ -x /bin/busybox ] || die "/bin/busybox not found: apt-get install busybox-static"
KVER=$(ls /lib/modules 2>/dev/null | grep -- '-amd64$' | sort -V | tail -1 || true)
[ -n "$KVER" ] && [ -f "/boot/vmlinuz-$KVER" ] || die "no Debian kernel with modules: apt-get install linux-image-amd64"
modinfo -k "$KVER" rdma_rxe >/dev/null 2>&1 || die "kernel $KVER has no rdma_rxe module"

WORK=$(mktemp -d /tmp/rxe-guest.XXXXXX)
KEEP_OUT=1
if [ -z "$OUT" ]; then OUT=$(mktemp -d /tmp/rxe-guest-out.XXXXXX); KEEP_OUT=0; fi
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cleanup() {
  rm -rf "$WORK"
  if [ "$KEEP_OUT" = 0 ]; then
    if [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then echo "rxe-guest: files left in $OUT" >&2; else rmdir "$OUT"; fi
  fi
}
trap cleanup EXIT
CTL="$WORK/ctl"; INIT="$WORK/initramfs"
mkdir -p "$CTL" "$INIT"/{bin,lib,proc,sys,dev,lower,upper,newroot}

# Stage 1 (initramfs): load virtio + 9p + overlay, mount the host's root read-only under a tmpfs overlay, switch.
MODS="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci netfs fscache 9pnet 9pnet_virtio 9p overlay"
LOADS=""                                        # insmod lines in dependency order (busybox insmod resolves none)
for m in $MODS; do
  f=$(modinfo -k "$KVER" -F filename "$m" 2>/dev/null || true)
  case "$f" in ""|"(builtin)") continue ;; esac      # built into this kernel: nothing to load
  cp "$f" "$INIT/lib/"; LOADS="$LOADS insmod /lib/$(basename "$f");"
done
cp /bin/busybox "$INIT/bin/"
for a in sh mount insmod switch_root mkdir; do ln -s busybox "$INIT/bin/$a"; done
cat > "$INIT/init" <<EOF
#!/bin/sh
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
$LOADS
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=1048576 hostroot /lower || exec sh
mount -t tmpfs tmpfs /upper && mkdir /upper/u /upper/w
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w /newroot || exec sh
mkdir -p /newroot$CTL
mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 ctl /newroot$CTL || exec sh
exec switch_root /newroot /bin/bash $CTL/stage2
EOF
chmod +x "$INIT/init"
(cd "$INIT" && find . | cpio -o -H newc 2>/dev/null | gzip -1) > "$WORK/initrd.gz"

# Stage 2 (the host's root, as root): devices, NICs with rxe, the environment, CMD; its status to $CTL/rc.
{
  for v in $(compgen -e); do
    case "$v" in KVPLUGINS_*|PYTHON*) printf 'export %s=%q\n' "$v" "${!v}" ;; esac
  done
  for v in ${GUEST_ENV:-}; do [ -n "${!v+x}" ] && printf 'export %s=%q\n' "$v" "${!v}"; done
  printf 'export KVPLUGINS_IN_GUEST=1 RXE_GUEST_OUT=%q TERM=dumb PY_COLORS=0 NO_COLOR=1\n' "$OUT"
  printf 'export RXE_HOST_CPU=%q\n' "$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
  printf 'export PATH=%q HOME=/root\n' "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
  printf 'cd %q\n' "$PWD"
  printf 'CMD=(%s)\n' "$(printf '%q ' "$@")"
} > "$CTL/env"
cat > "$CTL/stage2" <<EOF
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mount -t tmpfs tmpfs /run; mkdir -p /dev/shm; mount -t tmpfs tmpfs /dev/shm
mkdir -p "$OUT"; mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 out "$OUT"
modprobe virtio_net; modprobe rdma_rxe; modprobe ib_uverbs
ip link set lo up
i=0
for n in \$(ls /sys/class/net | grep -v '^lo\$' | sort); do
  ip link set "\$n" up; ip addr add 10.77.\$i.15/24 dev "\$n"; rdma link add rxe\$i type rxe netdev "\$n"; i=\$((i+1))
done
ulimit -l unlimited
dmesg -n 2; dmesg -C   # the console shows only EMERG/ALERT (panic, oops): no kernel line splits CMD's lines
. $CTL/env
# The newline ends the firmware's last line ("Booting from ROM..."), which the output filter drops whole.
printf '\nrxe-guest: up after %s s with %s rxe device(s); running CMD\n' "\$(cut -d' ' -f1 /proc/uptime)" \$i
"\${CMD[@]}"
rc=\$?
if [ \$rc != 0 ]; then
  echo "rxe-guest: CMD exited \$rc; the guest kernel's warnings while it ran (last 20):"
  dmesg -t --level=emerg,alert,crit,err,warn | grep -v 'speed is unknown' | tail -n 20 | sed 's/^/  kernel: /'
fi
echo \$rc > $CTL/rc
sync
exec >/dev/null 2>&1    # quiet: the 9p share vanishes under this script as the guest powers off
echo o > /proc/sysrq-trigger; sleep 60
EOF

NETS=()
for i in $(seq 0 $((NICS - 1))); do NETS+=(-netdev "user,id=n$i" -device "virtio-net-pci,netdev=n$i"); done
set +e
timeout -k 10 "$TIMEOUT" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m "$MEM" -smp 2 -nographic -no-reboot \
  -kernel "/boot/vmlinuz-$KVER" -initrd "$WORK/initrd.gz" -append "console=ttyS0 panic=-1 quiet" \
  -fsdev local,id=root,path=/,security_model=none,readonly=on,multidevs=remap \
  -device virtio-9p-pci,fsdev=root,mount_tag=hostroot \
  -fsdev local,id=ctl,path="$CTL",security_model=none -device virtio-9p-pci,fsdev=ctl,mount_tag=ctl \
  -fsdev local,id=out,path="$OUT",security_model=none -device virtio-9p-pci,fsdev=out,mount_tag=out \
  "${NETS[@]}" </dev/null | sed -u -e 's/\x1b\[[0-9;?]*[a-zA-Z]//g' -e 's/\x1bc//g' \
    -e 's/\r$//' -e '/^\[ *[0-9.]*\]/d' -e '/SeaBIOS\|iPXE\|Booting from ROM\|Press Ctrl-B/d' -e '/^[[:space:]]*$/d'
status=${PIPESTATUS[0]}
set -e
if [ "$status" = 124 ] || [ "$status" = 137 ]; then die "the guest ran past --timeout ${TIMEOUT} s; killed" 124; fi
[ -s "$CTL/rc" ] || die "the guest exited (qemu status $status) without reporting CMD's status: it did not boot, or CMD crashed the kernel" 125
exit "$(cat "$CTL/rc")"
