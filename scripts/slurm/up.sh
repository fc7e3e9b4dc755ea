#!/usr/bin/env bash
# A real single-node Slurm cluster with accounting (slurmdbd + MariaDB) on localhost, for the
# `slurm` tests and for trying sweeps locally. Debian 12, root, no systemd needed.
#
#   sudo scripts/slurm/up.sh      # install (once, ~40 s) + start; idempotent (~2 s when up)
#   scripts/slurm/down.sh         # stops only the daemons this script started
#
# Every daemon is started by this script in its own session and its PID recorded under
# $STATE/pids; package scripts are kept from starting services (policy-rc.d). Accounting is
# what lets submitit's sacct polls see a job killed outside Python (without it the driver waits
# forever). Partition `debug` (default), cluster `ratiolab`.
# Exits non-zero with a reason (and the daemon's log tail) when the cluster cannot come up.
set -euo pipefail

STATE=${RATIOLAB_SLURM_STATE:-/var/lib/ratiolab-slurm}
CLUSTER=ratiolab
PARTITION=debug
LOG=/var/log/ratiolab-slurm
DBPASS=ratiolab-slurm

say() { echo "[slurm-up] $*"; }
die() {
    echo "[slurm-up] ERROR: $*" >&2
    exit 1
}
tail_log() { [ -f "$1" ] && { echo "--- tail $1" >&2; tail -n 20 "$1" >&2; } || true; }
wait_for() { # wait_for SECONDS DESCRIPTION CMD...
    local t=$1 what=$2
    shift 2
    for _ in $(seq $((t * 4))); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.25
    done
    return 1
}
start_daemon() { # start_daemon NAME LOGFILE CMD... : own session, PID recorded for down.sh
    local name=$1 log=$2
    shift 2
    setsid "$@" >>"$log" 2>&1 </dev/null &
    echo $! >"$STATE/pids/$name"
    say "started $name (pid $!)"
}
alive() { # alive NAME: a daemon we started is still running
    local f="$STATE/pids/$1"
    [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

[ "$(id -u)" = 0 ] || die "must run as root (installs Debian packages, starts daemons)"
mkdir -p "$STATE/pids" "$LOG"

# --- 1. packages ------------------------------------------------------------------------------
PKGS="munge slurmctld slurmd slurm-client slurmdbd mariadb-server"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    say "installing:$missing"
    # keep package scripts from starting services: this script starts (and knows) every daemon
    policy=/usr/sbin/policy-rc.d
    had_policy=0
    [ -e $policy ] && had_policy=1
    if [ $had_policy = 0 ]; then
        printf '#!/bin/sh\nexit 101\n' >$policy
        chmod 755 $policy
    fi
    export DEBIAN_FRONTEND=noninteractive
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing) \
        >"$LOG/apt.log" 2>&1 || {
        [ $had_policy = 0 ] && rm -f $policy
        tail_log "$LOG/apt.log"
        die "apt-get install failed (log: $LOG/apt.log)"
    }
    [ $had_policy = 0 ] && rm -f $policy
fi

# --- 2. names ---------------------------------------------------------------------------------
HOST=$(hostname -s)
for n in localhost "$HOST"; do
    getent hosts "$n" >/dev/null || echo "127.0.0.1 $n" >>/etc/hosts
done

# --- 3. munge ---------------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    start_daemon munged "$LOG/munged.out" \
        setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
    wait_for 10 munge sh -c 'munge -n | unmunge' || {
        tail_log /var/log/munge/munged.log
        die "munged did not come up"
    }
fi

# --- 4. MariaDB -------------------------------------------------------------------------------
cat >/etc/mysql/mariadb.conf.d/99-ratiolab-slurm.cnf <<'EOF'
# written by ratiolab scripts/slurm/up.sh: settings slurmdbd asks for
[mariadbd]
innodb_buffer_pool_size=1G
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
EOF
if ! mariadb-admin ping >/dev/null 2>&1; then
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql >"$LOG/mariadb-install.log" 2>&1
    start_daemon mariadbd "$LOG/mariadbd.out" /usr/sbin/mariadbd --user=mysql \
        --log-error="$LOG/mariadbd.log" --pid-file=/run/mysqld/mysqld.pid
    wait_for 60 mariadb mariadb-admin ping || {
        tail_log "$LOG/mariadbd.log"
        die "mariadbd did not come up"
    }
fi
mariadb -u root <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF

# --- 5-7. Slurm configuration -----------------------------------------------------------------
install -d -o slurm -g slurm -m 0755 /var/log/slurm /var/spool/slurmctld /var/spool/slurmd \
    /run/slurm
CGROUP=""
if [ -d /sys/fs/cgroup/memory ] || [ -d /sys/fs/cgroup/cpuset ]; then
    CGROUP="CgroupPlugin=cgroup/v1"
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    CGROUP=$'CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes'
else
    die "/sys/fs/cgroup is not mounted; slurmd 22.05 always loads a cgroup plugin"
fi
changed=0
write_conf() { # write_conf PATH MODE OWNER: stdin -> PATH if different; sets changed=1
    local tmp
    tmp=$(mktemp)
    cat >"$tmp"
    if ! cmp -s "$tmp" "$1"; then
        install -m "$2" -o "$3" -g "$3" "$tmp" "$1"
        changed=1
    fi
    rm -f "$tmp"
}
write_conf /etc/slurm/cgroup.conf 644 root <<EOF
$CGROUP
EOF
write_conf /etc/slurm/slurmdbd.conf 600 slurm <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=slurm
LogFile=/var/log/slurm/slurmdbd.log
PidFile=/run/slurm/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db
EOF
NODE=$(slurmd -C | head -n 1 | sed "s/NodeName=[^ ]*/NodeName=$HOST/")
CPUS=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$NODE")
MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$NODE")
write_conf /etc/slurm/slurm.conf 644 root <<EOF
# written by ratiolab scripts/slurm/up.sh
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=15
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((MEM / CPUS))
ReturnToService=2
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
MinJobAge=30
SchedulerParameters=sched_interval=2
$NODE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF

# --- 8. start: slurmdbd, cluster, slurmctld, slurmd -------------------------------------------
if [ $changed = 1 ]; then
    # new configuration: restart what we started (daemons started elsewhere are left alone)
    for d in slurmd slurmctld slurmdbd; do
        if alive $d; then
            kill "$(cat "$STATE/pids/$d")" 2>/dev/null || true
            wait_for 15 "$d exit" sh -c "! kill -0 $(cat "$STATE/pids/$d")" || true
            rm -f "$STATE/pids/$d"
        fi
    done
fi
if ! sacctmgr -n show cluster >/dev/null 2>&1; then
    start_daemon slurmdbd "$LOG/slurmdbd.out" /usr/sbin/slurmdbd -D
    # the first start creates the schema
    wait_for 60 slurmdbd sacctmgr -n show cluster || {
        tail_log /var/log/slurm/slurmdbd.log
        die "slurmdbd did not come up"
    }
fi
sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" ||
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
if ! scontrol ping 2>/dev/null | grep -q UP; then
    # a root slurmctld shutting down writes root-only state files: fix ownership just before start
    chown -R slurm:slurm /var/spool/slurmctld
    start_daemon slurmctld "$LOG/slurmctld.out" /usr/sbin/slurmctld -D
    wait_for 30 slurmctld sh -c 'scontrol ping | grep -q UP' || {
        tail_log /var/log/slurm/slurmctld.log
        die "slurmctld did not come up"
    }
fi
node_ok() { sinfo -h -N -o '%t' | grep -Eq '^(idle|mix|alloc)'; }
if ! node_ok; then
    if ! alive slurmd && ! pgrep -x slurmd >/dev/null; then
        start_daemon slurmd "$LOG/slurmd.out" /usr/sbin/slurmd -D
    fi
    wait_for 30 "node idle" node_ok || {
        sinfo -N >&2 || true
        tail_log /var/log/slurm/slurmd.log
        die "node did not become idle"
    }
fi

# --- 9. checks --------------------------------------------------------------------------------
sacct -n -X -S now-1minute >/dev/null || die "sacct fails: accounting is not working"
if [ ! -f "$STATE/smoke-ok" ] || [ $changed = 1 ]; then
    jid=$(sbatch --parsable --wrap true --mem=50M -t 1 -o /dev/null)
    wait_for 60 "smoke job $jid" sh -c "sacct -n -X -P -j $jid -o State | grep -qx COMPLETED" || {
        sacct -j "$jid" >&2 || true
        die "smoke job $jid did not reach COMPLETED in sacct"
    }
    touch "$STATE/smoke-ok"
fi
say "up: cluster $CLUSTER, partition $PARTITION, node $HOST ($CPUS CPUs, ${MEM} MB)"
