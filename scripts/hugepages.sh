#!/usr/bin/env bash
# Reserve 2 MiB huge pages and mount a hugetlbfs for the hugetlb tier, as root,
# and put the previous setting back afterwards.
#
#   scripts/hugepages.sh setup [GIB] [MOUNT]   grow the pool by GIB (default 2) and
#                                              mount hugetlbfs at MOUNT (default
#                                              /mnt/concordia-huge); prints MOUNT
#   scripts/hugepages.sh teardown [MOUNT]      unmount it, remove what is left on
#                                              it, and give the pages back
#   scripts/hugepages.sh status                the pool and the mounts
#
# setup records the pages it added in MOUNT.state beside the mount point;
# teardown takes exactly those away again, so another user's reservation made
# meanwhile is kept.  Exit 0 done, 2 not root / no hugetlbfs / not enough pages
# (nothing is left changed then).
set -uo pipefail
NR=/proc/sys/vm/nr_hugepages
cmd=${1:-}
die() { echo "hugepages: $*" >&2; exit 2; }
free_pages() { cat /sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages; }
# What shared memory holds, and the largest entry of /dev/shm: a log left there
# by a run cut short (a SIGKILL after timeout's grace) is the usual taker.
shm_held() {
  local kib top
  kib=$(awk '/^Shmem:/ {print $2}' /proc/meminfo)
  top=$(du -sk /dev/shm/* 2>/dev/null | sort -n | tail -n 1)
  awk -v k="${kib:-0}" 'BEGIN { printf "shared memory holds %.1f GiB", k / 1048576 }'
  [ -n "$top" ] && awk -v k="${top%%[[:space:]]*}" -v p="${top#*[[:space:]]}" \
    'BEGIN { printf ", the most of it %.1f GiB in %s", k / 1048576, p }'
  return 0
}

case "$cmd" in
setup)
  gib=${2:-2}; mnt=${3:-/mnt/concordia-huge}; state="$mnt.state"
  [ "$(id -u)" -eq 0 ] || die "setup needs root"
  grep -qw hugetlbfs /proc/filesystems || die "this kernel has no hugetlbfs"
  [ -e "$state" ] && die "$mnt is set up already ($state exists): teardown first"
  want=$(python3 -c "import math,sys; print(math.ceil(float(sys.argv[1]) * 512))" "$gib") \
    || die "not a number of GiB: $gib"
  before=$(cat "$NR")
  echo $((before + want)) > "$NR" 2>/dev/null || die "cannot write $NR"
  got=$(( $(cat "$NR") - before ))
  if [ "$got" -lt "$want" ]; then
    echo "$before" > "$NR"
    die "the kernel found $got of the $want huge pages asked for (memory is taken or fragmented; $(shm_held))"
  fi
  mkdir -p "$mnt"
  if ! mount -t hugetlbfs -o pagesize=2M,mode=1777 none "$mnt"; then
    echo "$before" > "$NR"
    die "mount -t hugetlbfs at $mnt failed"
  fi
  echo "$got" > "$state"
  echo "hugepages: $got pages of 2 MiB ($(free_pages) free) on $mnt (previous pool: $before)" >&2
  echo "$mnt"
  ;;
teardown)
  mnt=${2:-/mnt/concordia-huge}; state="$mnt.state"
  [ "$(id -u)" -eq 0 ] || die "teardown needs root"
  [ -e "$state" ] || die "$mnt was not set up by this script (no $state)"
  added=$(cat "$state")
  find "$mnt" -mindepth 1 -delete 2>/dev/null
  umount "$mnt" || die "cannot unmount $mnt (a process still maps a file there?)"
  rmdir "$mnt" 2>/dev/null
  now=$(cat "$NR")
  echo $(( now > added ? now - added : 0 )) > "$NR"
  rm -f "$state"
  echo "hugepages: gave back $added pages; pool now $(cat "$NR")" >&2
  ;;
status)
  grep -i '^HugePages_\|^Hugepagesize' /proc/meminfo
  grep hugetlbfs /proc/self/mounts || echo "no hugetlbfs mounted"
  ;;
*)
  echo "usage: $0 setup [GIB] [MOUNT] | teardown [MOUNT] | status" >&2; exit 2 ;;
esac
