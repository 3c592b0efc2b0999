#!/usr/bin/env bash
# A single-node SLURM cluster on localhost, for CI and for trying the SLURM profiles on one machine.
#
#   scripts/slurm-cluster.sh start   # install slurm-wlm + munge if missing, write slurm.conf, start daemons
#   scripts/slurm-cluster.sh stop    # cancel every job, stop the daemons this script started
#   eval "$(scripts/slurm-cluster.sh env)"   # point sinfo/sbatch/snakemake at the cluster (SLURM_CONF)
#
# One node (`localhost`, this machine's CPUs and 90 % of its memory) in two partitions, `cpu` (default)
# and `gpu`: `gpu` is a CPU partition with that name, so the GPU profile's partition exists; there is
# no GRES. No accounting database (AccountingStorageType=none): the Snakemake executor queries job
# states with squeue, which keeps finished jobs for MinJobAge = 3600 s (the tests read them back).
# Needs root (apt-get, munged as the munge user, slurmd). The configuration is /etc/slurm/slurm.conf
# (srun inside a job reads the default path, whatever SLURM_CONF says); the script refuses to overwrite
# one it did not write, and stop removes its own. Everything else the cluster writes (state, logs, pid
# files) lives in $ICLNOISE_SLURM_DIR.
set -euo pipefail
DIR=${ICLNOISE_SLURM_DIR:-/tmp/iclnoise-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by iclnoise scripts/slurm-cluster.sh"
export SLURM_CONF=$CONF

log() { echo "[slurm-cluster] $*" >&2; }

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null; then
        return
    fi
    log "installing slurm-wlm and munge with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

ours() { [[ -f $CONF ]] && [[ $(head -1 "$CONF") == "$MARK" ]]; }

write_conf() {
    if [[ -f $CONF ]] && ! ours; then
        log "$CONF exists and was not written by this script: not touching it"
        return 1
    fi
    mkdir -p "$DIR/ctld" "$DIR/d" "$(dirname "$CONF")"
    # the node line from slurmd -C (exact CPU topology), renamed and with 90 % of the memory
    local node mem
    node=$(slurmd -C | head -1)
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    node=$(sed -E "s/^NodeName=[^ ]+/NodeName=localhost/; s/RealMemory=[0-9]+/RealMemory=$mem/" <<<"$node")
    cat >"$CONF" <<CONF
$MARK
ClusterName=iclnoise
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/d
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
ReturnToService=2
MinJobAge=3600
KillWait=5
$node State=UNKNOWN
PartitionName=cpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=localhost MaxTime=INFINITE State=UP
CONF
}

alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    install
    mkdir -p "$DIR"
    write_conf
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        [[ -f /etc/munge/munge.key ]] || { mungekey --create >/dev/null 2>&1 || create-munge-key -f; }
        chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
        runuser -u munge -- /usr/sbin/munged
        sleep 1
        cp /run/munge/munged.pid "$DIR/munged.pid"  # started here: stop ends it
        log "munged started"
    fi
    if ! alive "$DIR/slurmctld.pid"; then
        rm -rf "$DIR/ctld" "$DIR/d" && mkdir -p "$DIR/ctld" "$DIR/d"  # a fresh cluster: no jobs from an earlier one
        slurmctld -f "$CONF"
    fi
    alive "$DIR/slurmd.pid" || slurmd -f "$CONF" -N localhost
    local i state
    for i in $(seq 60); do
        state=$(sinfo -h -n localhost -o %T 2>/dev/null | sort -u | tr '\n' ' ')
        if [[ $state == "idle " ]]; then
            log "node localhost idle (partitions: $(sinfo -h -o %P | tr '\n' ' '))"
            return 0
        fi
        sleep 1
    done
    log "node not idle after 60 s (state: ${state:-none}); logs in $DIR"
    tail -20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 || true
    return 1
}

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM, wait up to 20 s, then SIGKILL
    local pid
    alive "$2" || { rm -f "$2"; return 0; }
    pid=$(cat "$2")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    rm -f "$2"
    log "$1 stopped"
}

stop() {
    if ours && alive "$DIR/slurmctld.pid"; then
        scancel --full --user "$(id -un)" 2>/dev/null || true
        for _ in $(seq 30); do  # let running jobs end before their slurmd goes
            [[ -z $(squeue -h -t RUNNING,COMPLETING -o %i 2>/dev/null) ]] && break
            sleep 1
        done
    fi
    stop_pid slurmd "$DIR/slurmd.pid"
    stop_pid slurmctld "$DIR/slurmctld.pid"
    stop_pid munged "$DIR/munged.pid"
    if ours; then rm -f "$CONF"; fi
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
