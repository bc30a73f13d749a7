#!/usr/bin/env bash
# A real SLURM for development and CI:  slurm/dev-cluster.sh up [--nodes N]|down [--purge]|status
#
#   up      install the Debian packages if missing, then start munge, MariaDB, slurmdbd, slurmctld
#           and the compute nodes' slurmd; wait until every node is idle and `sacct` answers.
#           Idempotent: daemons that already run are left alone. Prints how long it took.
#           --nodes N (default 1, or HPCSPLIT_DEV_CLUSTER_NODES): N = 1 is one node, this host, at
#           127.0.0.1. N >= 2 gives N compute nodes node1..nodeN, each in its own network, UTS and mount
#           namespace (see "Several nodes" below). `up` with another N than the running cluster's takes
#           it down first (the accounting database is kept).
#   down    stop the daemons this script started (by PID) and remove the namespaces, veths and bridge
#           it made. State (the accounting database) is kept; `down --purge` also removes the state
#           folder.
#   status  the nodes (name, address, state), squeue and sacct health; exit 1 when not usable.
#
# Several nodes (--nodes N >= 2; docs/cluster.md "Multi-node dev cluster"): a bridge hsbr0 in this
# namespace with $NET.1/24 (slurmctld's address), and per node i a network namespace hsnode<i>
# (/run/netns/hsnode<i>) joined to the bridge by a veth pair (hsv<i> here, eth0 there) with address
# $NET.(10+i). Its slurmd starts under `nsenter --net=` (not `ip netns exec`, which remounts /sys and
# hides the cgroup tree slurmd needs) and `unshare --uts --mount --propagation private`, which gives the
# node its hostname node<i>, a hosts file naming the nodes, a private /dev/shm (MPICH's segment names
# of two nodes would collide) and its own /proc/sys/kernel/random/boot_id (UCX takes a shared boot_id
# for "same host" and would use shared memory between the nodes; with distinct ones MPI goes over TCP on
# eth0 as between real nodes). Job steps inherit the node's namespaces from its slurmd. Only the
# addresses this script assigns, on the devices it creates, are used; the network is checked unused
# first. No traffic leaves the machine.
#
# Needs root on Debian 12 (slurm-wlm 22.05). The node advertises 8 CPUs (SlurmdParameters=
# config_overrides) so that multi-rank jobs schedule on a 2-core machine, and 4 fake GPUs (gres
# files that are symlinks to /dev/null): jobs get CUDA_VISIBLE_DEVICES/SLURM_JOB_GPUS but there is no
# CUDA behind them. Accounting is real (slurmdbd + MariaDB), so `sacct` answers as on a site cluster.
#
# Settings (environment):
#   HPCSPLIT_DEV_CLUSTER_DIR   state/log/spool folder (default /var/tmp/hpcsplit-dev-cluster)
#   HPCSPLIT_DEV_CLUSTER_CPUS  CPUs the node advertises (default 8)
#   HPCSPLIT_DEV_CLUSTER_GPUS  fake GPUs (default 4) per node
#   HPCSPLIT_DEV_CLUSTER_NODES compute nodes when `up` has no --nodes (default 1)
#   HPCSPLIT_DEV_CLUSTER_NET   first three octets of the nodes' /24 (default 10.213.0)
#
# Config files go to /etc/slurm (where sbatch/srun/sacct look without SLURM_CONF). The script refuses to
# overwrite a slurm.conf it did not write.
set -euo pipefail

STATE=${HPCSPLIT_DEV_CLUSTER_DIR:-/var/tmp/hpcsplit-dev-cluster}
NCPUS=${HPCSPLIT_DEV_CLUSTER_CPUS:-8}
NGPUS=${HPCSPLIT_DEV_CLUSTER_GPUS:-4}
NET=${HPCSPLIT_DEV_CLUSTER_NET:-10.213.0}
BRIDGE=hsbr0
NNODES=  # set by `up --nodes N`, else read from $STATE/node-count (the running cluster's count)
ETC=/etc/slurm
MARK="# written by hpcsplit slurm/dev-cluster.sh"
HOST=$(hostname -s)
CLUSTER=hpcsplit-dev
PARTITION=debug
DB_SOCK=/run/mysqld/mysqld.sock
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server mariadb-client libpmix2)

log() { printf '[dev-cluster] %s\n' "$*"; }
die() { printf '[dev-cluster] ERROR: %s\n' "$*" >&2; exit 1; }

saved_nodes() { cat "$STATE/node-count" 2>/dev/null || echo 1; }
node_names() {  # the compute nodes' names, one a line
    if (( NNODES == 1 )); then echo "$HOST"; else for (( i = 1; i <= NNODES; i++ )); do echo "node$i"; done; fi
}
node_addr() { echo "$NET.$(( 10 + $1 ))"; }  # node_addr I -> node I's address (N >= 2)
ctl_addr() { if (( NNODES == 1 )); then echo 127.0.0.1; else echo "$NET.1"; fi; }
slurmd_pidfile() {  # slurmd_pidfile NODE
    if (( NNODES == 1 )); then echo "$STATE/run/slurmd.pid"; else echo "$STATE/run/slurmd-$1.pid"; fi
}

pid_alive() {  # pid_alive FILE -> 0 when the PID in FILE runs (a zombie does not)
    [[ -s $1 ]] || return 1
    local pid
    pid=$(cat "$1")
    kill -0 "$pid" 2>/dev/null && [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

daemon_alive() {  # daemon_alive NAME FILE -> 0 when the PID in FILE runs and is NAME
    pid_alive "$2" && [[ $(cat "/proc/$(cat "$2")/comm" 2>/dev/null) == "$1" ]]
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2
    shift 2
    local t0=$SECONDS
    until "$@" >/dev/null 2>&1; do
        if (( SECONDS - t0 >= limit )); then
            return 1
        fi
        sleep 0.5
    done
    log "$what ready after $(( SECONDS - t0 )) s"
}

install_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if (( ${#missing[@]} == 0 )); then
        return
    fi
    [[ $(id -u) == 0 ]] || die "missing Debian packages: ${missing[*]}; run as root to install them"
    log "installing ${missing[*]}"
    # Keep package scripts from starting services (no systemd here; we start daemons by hand).
    local policy=/usr/sbin/policy-rc.d ours=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        ours=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    local ok=1
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || ok=0
    if (( ours )); then rm -f "$policy"; fi
    (( ok )) || die "apt-get could not install ${missing[*]}"
}

write_configs() {
    mkdir -p "$ETC" "$STATE"/{log,run,state,spool/slurmd,dev}
    if [[ -e $ETC/slurm.conf ]] && ! grep -qF "$MARK" "$ETC/slurm.conf"; then
        die "$ETC/slurm.conf exists and was not written by this script; not touching a real cluster's config"
    fi
    local i files
    for (( i = 0; i < NGPUS; i++ )); do
        ln -sfn /dev/null "$STATE/dev/nvidia$i"
    done
    local mem_mb
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    local gres_line="" gres_types="" node_lines="" nodes_expr="$HOST" per_node="" ctl
    ctl=$(ctl_addr)
    if (( NGPUS > 0 )); then
        gres_line="Gres=gpu:$NGPUS"
        gres_types="GresTypes=gpu"
        files="$STATE/dev/nvidia[0-$(( NGPUS - 1 ))]"
    fi
    local node_opts="CPUs=$NCPUS Sockets=1 CoresPerSocket=$NCPUS ThreadsPerCore=1 RealMemory=$mem_mb $gres_line State=UNKNOWN"
    if (( NNODES == 1 )); then
        node_lines="NodeName=$HOST NodeAddr=127.0.0.1 $node_opts"
        per_node="SlurmdPidFile=$STATE/run/slurmd.pid
SlurmdSpoolDir=$STATE/spool/slurmd
SlurmdLogFile=$STATE/log/slurmd.log"
    else
        for (( i = 1; i <= NNODES; i++ )); do
            node_lines+="NodeName=node$i NodeAddr=$(node_addr "$i") $node_opts"$'\n'
        done
        nodes_expr="node[1-$NNODES]"
        # %n: the node's name, so that every slurmd has its own (SlurmdTimeout: a dead node is DOWN in ~35 s)
        per_node="SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmdSpoolDir=$STATE/spool/slurmd-%n
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmdTimeout=30"
    fi
    # Job ids must never repeat, even after `down --purge`: MPICH names its shared-memory segments after
    # the PMI job id, and a segment left by a killed rank of an earlier job with the same id makes
    # MPI_Init spin forever. Start from the clock (used only when there is no saved state), and let the
    # epilog remove segments that no process maps any more (real sites clean /dev/shm between jobs).
    local first_job_id
    first_job_id=$(sed -n 's/^FirstJobId=//p' "$ETC/slurm.conf" 2>/dev/null || true)
    if [[ -z $first_job_id || ! -e $STATE/state/job_state ]]; then
        first_job_id=$(( $(date +%s) % 60000000 + 1000 ))
    fi
    cat >"$STATE/epilog.sh" <<'EOS'
#!/bin/bash
# hpcsplit dev cluster epilog: remove MPICH shared-memory segments that no process maps any more.
shopt -s nullglob
segments=(/dev/shm/mpich_shm_*)
(( ${#segments[@]} )) || exit 0
in_use=$({
    cat /proc/[0-9]*/maps 2>/dev/null | grep -o '/dev/shm/mpich_shm_[^ ]*'
    find /proc/[0-9]*/fd -lname '/dev/shm/mpich_shm_*' -printf '%l\n' 2>/dev/null
} | sort -u)
for f in "${segments[@]}"; do
    grep -qxF "$f" <<<"$in_use" || rm -f "$f"
done
exit 0
EOS
    chmod 755 "$STATE/epilog.sh"
    cat >"$ETC/slurm.conf.new" <<EOF
$MARK
ClusterName=$CLUSTER
SlurmctldHost=$HOST($ctl)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
FirstJobId=$first_job_id
Epilog=$STATE/epilog.sh
KillWait=5
InactiveLimit=0
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE/state
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
$per_node
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$HOST
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$gres_types
$node_lines
PartitionName=$PARTITION Nodes=$nodes_expr Default=YES MaxTime=INFINITE State=UP
EOF
    if cmp -s "$ETC/slurm.conf.new" "$ETC/slurm.conf"; then
        rm -f "$ETC/slurm.conf.new"
    else
        mv "$ETC/slurm.conf.new" "$ETC/slurm.conf"
    fi
    {
        echo "$MARK"
        echo "AutoDetect=off"
        if (( NGPUS > 0 )); then echo "Name=gpu File=$files"; fi
    } >"$ETC/gres.conf"
    # slurmdbd refuses a config readable by others.
    (
        umask 077
        cat >"$ETC/slurmdbd.conf" <<EOF
$MARK
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=hpcsplit-dev
StorageLoc=slurm_acct_db
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
EOF
    )
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    wait_for 20 munge sh -c 'munge -n | unmunge' || die "munged did not start (see /var/log/munge/munged.log)"
    if [[ -s /run/munge/munged.pid ]]; then
        cp /run/munge/munged.pid "$STATE/run/munged.pid.ours"
    else
        pgrep -u munge -x munged | tail -1 >"$STATE/run/munged.pid.ours" || true
    fi
}

db_ping() { mariadb-admin --socket="$DB_SOCK" ping; }

start_mariadb() {
    if ! db_ping >/dev/null 2>&1; then
        local datadir=$STATE/mysql
        if [[ ! -d $datadir/mysql ]]; then
            log "initialising MariaDB in $datadir"
            install -d -o mysql -g mysql "$datadir"
            mariadb-install-db --user=mysql --datadir="$datadir" --skip-test-db \
                >"$STATE/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed: see $STATE/log/mariadb-install.log"
        fi
        install -d -o mysql -g mysql -m 0755 /run/mysqld "$STATE/log/mariadb"
        if [[ -e $STATE/log/mariadb/error.log ]]; then
            mv -f "$STATE/log/mariadb/error.log" "$STATE/log/mariadb/error.log.old"
        fi
        runuser -u mysql -- /usr/sbin/mariadbd --datadir="$datadir" --socket="$DB_SOCK" \
            --pid-file=/run/mysqld/hpcsplit-dev.pid --skip-networking --log-error="$STATE/log/mariadb/error.log" \
            --innodb-buffer-pool-size=64M --innodb-log-file-size=16M >/dev/null 2>&1 &
        disown
        local t0=$SECONDS
        until db_ping >/dev/null 2>&1; do
            if (( SECONDS - t0 > 60 )) || grep -q "ERROR.*Can't start server\|Aborting" "$STATE/log/mariadb/error.log" 2>/dev/null; then
                tail -n 5 "$STATE/log/mariadb/error.log" >&2 || true
                die "MariaDB did not start: see $STATE/log/mariadb/error.log"
            fi
            sleep 0.5
        done
        log "MariaDB ready after $(( SECONDS - t0 )) s"
        cp /run/mysqld/hpcsplit-dev.pid "$STATE/run/mariadbd.pid.ours"
    fi
    mariadb --socket="$DB_SOCK" -e "
        CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'hpcsplit-dev';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" \
        || die "could not create the accounting database (is this MariaDB's root user allowed via its socket?)"
}

start_slurm() {
    if ! daemon_alive slurmdbd "$STATE/run/slurmdbd.pid"; then
        slurmdbd || die "slurmdbd did not start: see $STATE/log/slurmdbd.log"
        wait_for 30 slurmdbd sacctmgr -n -i show cluster \
            || die "slurmdbd does not answer: see $STATE/log/slurmdbd.log"
    fi
    if ! daemon_alive slurmctld "$STATE/run/slurmctld.pid"; then
        # Keep the saved state (no -c): job ids must keep growing, since slurmdbd remembers old ones.
        # A node left DOWN/DRAINED by an earlier run is resumed below.
        slurmctld || die "slurmctld did not start: see $STATE/log/slurmctld.log"
        wait_for 30 slurmctld scontrol ping || die "slurmctld does not answer: see $STATE/log/slurmctld.log"
    fi
    if (( NNODES == 1 )); then
        if ! daemon_alive slurmd "$STATE/run/slurmd.pid"; then
            slurmd || die "slurmd did not start: see $STATE/log/slurmd.log"
        fi
    else
        for (( i = 1; i <= NNODES; i++ )); do start_node_slurmd "$i"; done
    fi
    local n
    for n in $(node_names); do
        if ! wait_for 60 "node $n idle" node_usable "$n"; then
            log "node $n is $(node_state "$n"); resuming it"
            scontrol update nodename="$n" state=resume || true
            wait_for 30 "node $n idle" node_usable "$n" \
                || die "node $n is $(node_state "$n"): see $STATE/log/slurmd*.log and slurmctld.log"
        fi
    done
    wait_for 30 sacct sacct -n -X -S now-1minute || die "sacct does not answer: see $STATE/log/slurmdbd.log"
}

node_state() { sinfo -h -n "${1:-$HOST}" -o %T 2>/dev/null | head -1; }  # node_state [NODE]
node_usable() { [[ $(node_state "${1:-$HOST}") =~ ^(idle|mixed|allocated|completing)$ ]]; }

# ---- several nodes: a bridge, and per node a network namespace joined to it by a veth pair ----

net_check_free() {  # refuse a network that this machine already uses (other than on our own devices)
    local used
    used=$(ip -o -4 addr show | awk -v b="$BRIDGE" '$2 != b {print $2, $4}' | grep -F " $NET." || true)
    [[ -z $used ]] || die "$NET.0/24 is already used on this machine ($used): set HPCSPLIT_DEV_CLUSTER_NET"
    used=$(ip -4 route show | grep -v " dev $BRIDGE " | grep -F "$NET." || true)
    [[ -z $used ]] || die "$NET.0/24 is already routed on this machine ($used): set HPCSPLIT_DEV_CLUSTER_NET"
}

net_up() {  # the bridge and node namespaces (idempotent)
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        net_check_free
        ip link add "$BRIDGE" type bridge
        ip addr add "$NET.1/24" dev "$BRIDGE"
        ip link set "$BRIDGE" up
    fi
    local i ns
    for (( i = 1; i <= NNODES; i++ )); do
        ns=hsnode$i
        [[ -e /run/netns/$ns ]] || ip netns add "$ns"
        if ! ip link show "hsv$i" >/dev/null 2>&1; then
            ip link add "hsv$i" type veth peer name eth0 netns "$ns"
            ip link set "hsv$i" master "$BRIDGE" up
            ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
            ip -n "$ns" link set eth0 up
            ip -n "$ns" link set lo up
        fi
    done
}

net_down() {  # every namespace, veth and the bridge this script made (any node count)
    local ns
    for ns in /run/netns/hsnode*; do
        [[ -e $ns ]] || continue
        ip netns del "${ns##*/}" 2>/dev/null || true  # takes its veth end (and so the pair) with it
    done
    for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^hsv[0-9]+$' || true); do
        ip link del "$l" 2>/dev/null || true
    done
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link del "$BRIDGE"
        log "removed bridge $BRIDGE and the node namespaces"
    fi
}

start_node_slurmd() {  # start_node_slurmd I: node I's slurmd inside its namespaces
    local i=$1 name=node$1 dir=$STATE/nodes/node$1
    daemon_alive slurmd "$(slurmd_pidfile "$name")" && return
    mkdir -p "$dir" "$STATE/spool/slurmd-$name"
    {
        echo "127.0.0.1 localhost"
        echo "$NET.1 $HOST"
        for (( k = 1; k <= NNODES; k++ )); do echo "$(node_addr "$k") node$k"; done
    } >"$dir/hosts"
    # a boot_id of the node's own, fixed per node name (UCX: another boot_id = another host)
    [[ -s $dir/boot_id ]] || cat /proc/sys/kernel/random/uuid >"$dir/boot_id"
    nsenter --net="/run/netns/hsnode$i" -- unshare --uts --mount --propagation private -- /bin/sh -ec '
        hostname "$1"
        mount -t tmpfs -o mode=1777 tmpfs /dev/shm
        mount --bind "$2/boot_id" /proc/sys/kernel/random/boot_id
        mount --bind "$2/hosts" /etc/hosts
        exec slurmd -N "$1"' sh "$name" "$dir" \
        || die "slurmd of $name did not start: see $STATE/log/slurmd-$name.log"
}

stop_pidfile() {  # stop_pidfile NAME FILE: stop the process only if it still is NAME (PIDs get reused)
    local name=$1 file=$2
    if pid_alive "$file" && [[ $(cat "/proc/$(cat "$file")/comm" 2>/dev/null) == "$name" ]]; then
        local pid
        pid=$(cat "$file")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 40); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        if kill -0 "$pid" 2>/dev/null; then
            kill -9 "$pid" 2>/dev/null || true
        fi
        log "stopped $name (pid $pid)"
    fi
    rm -f "$file"
}

cmd_up() {
    local t0=$SECONDS want=${HPCSPLIT_DEV_CLUSTER_NODES:-1}
    while (( $# )); do
        case $1 in
            --nodes) want=${2:-}; shift 2 || die "--nodes needs a count" ;;
            --nodes=*) want=${1#--nodes=}; shift ;;
            *) die "up: unknown option $1 (usage: up [--nodes N])" ;;
        esac
    done
    [[ $want =~ ^[1-9][0-9]*$ ]] && (( want <= 16 )) || die "--nodes $want: give a count from 1 to 16"
    [[ $(id -u) == 0 ]] || die "run as root (the dev cluster runs its daemons as root)"
    install_packages
    if [[ -d $STATE ]] && (( $(saved_nodes) != want )) && daemon_alive slurmctld "$STATE/run/slurmctld.pid"; then
        log "the cluster runs $(saved_nodes) node(s); taking it down for $want"
        NNODES=$(saved_nodes) cmd_down
    fi
    NNODES=$want
    mkdir -p "$STATE"
    if (( NNODES > 1 )); then
        command -v nsenter >/dev/null && command -v unshare >/dev/null || die "needs nsenter and unshare (util-linux)"
        net_up
    else
        net_down  # a multi-node cluster's network left behind
    fi
    write_configs
    echo "$NNODES" >"$STATE/node-count"
    "$STATE/epilog.sh" || true  # segments left by ranks killed before this `up`
    start_munge
    start_mariadb
    start_slurm
    log "up in $(( SECONDS - t0 )) s: cluster $CLUSTER, partition $PARTITION, node(s) $(node_names | paste -sd, -)" \
        "($NCPUS CPUs, gpu:$NGPUS fake each), logs in $STATE/log"
}

cmd_down() {
    local f
    for f in "$STATE"/run/slurmd.pid "$STATE"/run/slurmd-*.pid; do
        [[ -e $f ]] && stop_pidfile slurmd "$f"
    done
    stop_pidfile slurmctld "$STATE/run/slurmctld.pid"
    stop_pidfile slurmdbd "$STATE/run/slurmdbd.pid"
    if [[ -e $STATE/run/mariadbd.pid.ours ]]; then
        stop_pidfile mariadbd "$STATE/run/mariadbd.pid.ours"
    fi
    if [[ -e $STATE/run/munged.pid.ours ]]; then
        stop_pidfile munged "$STATE/run/munged.pid.ours"
    fi
    net_down
    if [[ ${1:-} == --purge ]]; then
        rm -rf "$STATE"
        for f in slurm.conf gres.conf slurmdbd.conf; do
            if [[ -e $ETC/$f ]] && grep -qF "$MARK" "$ETC/$f"; then rm -f "$ETC/$f"; fi
        done
        log "removed $STATE and the configs in $ETC"
    fi
    log "down"
}

cmd_status() {
    local ok=0 n pf
    NNODES=$(saved_nodes)
    for d in slurmdbd slurmctld; do
        if daemon_alive "$d" "$STATE/run/$d.pid"; then
            log "$d running (pid $(cat "$STATE/run/$d.pid"))"
        else
            log "$d NOT running"
            ok=1
        fi
    done
    for n in $(node_names); do
        pf=$(slurmd_pidfile "$n")
        if daemon_alive slurmd "$pf"; then
            log "slurmd of $n running (pid $(cat "$pf"))"
        else
            log "slurmd of $n NOT running"
            ok=1
        fi
    done
    log "$NNODES node(s):"
    if command -v sinfo >/dev/null && sinfo -N -o '%N %o %T %c %G %P' 2>&1; then :; else ok=1; fi
    squeue 2>&1 || ok=1
    if sacct -X -S now-1hour -o JobID,JobName%20,State,ExitCode,Elapsed 2>&1 | tail -n 10; then
        log "sacct answers"
    else
        ok=1
    fi
    local states=""
    for n in $(node_names); do
        node_usable "$n" || ok=1
        states+=" $n $(node_state "$n")"
    done
    if (( ok == 0 )); then
        log "healthy: nodes=$NNODES:$states"
    else
        log "NOT healthy (logs in $STATE/log)"
        return 1
    fi
}

case ${1:-} in
    up) shift; cmd_up "$@" ;;
    down) shift; NNODES=$(saved_nodes); cmd_down "$@" ;;
    status) cmd_status ;;
    *) echo "usage: $0 up [--nodes N]|down [--purge]|status" >&2; exit 2 ;;
esac
