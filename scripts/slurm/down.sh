#!/usr/bin/env bash
# Stop the daemons scripts/slurm/up.sh started (by their recorded PIDs), in reverse start order.
# Daemons it did not start, packages, configuration and the accounting database are left alone.
set -uo pipefail

STATE=${RATIOLAB_SLURM_STATE:-/var/lib/ratiolab-slurm}
[ -d "$STATE/pids" ] || {
    echo "[slurm-down] nothing started by up.sh"
    exit 0
}
# jobs still running would outlive slurmd (they are in their own sessions): cancel them first
if [ -f "$STATE/pids/slurmctld" ] && kill -0 "$(cat "$STATE/pids/slurmctld")" 2>/dev/null; then
    squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
fi
for d in slurmd slurmctld slurmdbd mariadbd munged; do
    f="$STATE/pids/$d"
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        for _ in $(seq 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
        echo "[slurm-down] stopped $d (pid $pid)"
    fi
    rm -f "$f"
done
rm -f "$STATE/smoke-ok"
