set -eu
hostname node2
mount --rbind /sys/fs/cgroup /srv/fsdp-local/state-multi/mnt/node2/cgroup
mount -t sysfs sysfs /sys
mount --move /srv/fsdp-local/state-multi/mnt/node2/cgroup /sys/fs/cgroup
mount --bind /srv/fsdp-local/state-multi/etc/hosts /etc/hosts
mount --bind /srv/fsdp-local/state-multi/etc/nsswitch.conf /etc/nsswitch.conf
mount -t tmpfs -o mode=1777 tmpfs-node2 /srv/fsdp-local/state-multi/mnt/node2/tmp
mkdir -p /srv/fsdp-local/state-multi/mnt/node2/tmp/ci/fsdp-utils
mount --rbind /tmp/ci/fsdp-utils /srv/fsdp-local/state-multi/mnt/node2/tmp/ci/fsdp-utils
mount --move /srv/fsdp-local/state-multi/mnt/node2/tmp /tmp
mount -t tmpfs -o mode=1777 shm-node2 /dev/shm
exec /usr/sbin/slurmd -f /srv/fsdp-local/state-multi/etc/slurm.conf -N node2
