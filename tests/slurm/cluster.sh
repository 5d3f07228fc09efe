#!/usr/bin/env bash
# A real single-host SLURM cluster for the SLURM tests: Debian's slurm-wlm + munge, no systemd.
#
#   tests/slurm/cluster.sh install   apt-get the packages (root; idempotent)
#   tests/slurm/cluster.sh start     write /etc/slurm/{slurm,gres}.conf, start munged, slurmctld and two slurmd
#   tests/slurm/cluster.sh stop      stop the daemons this script started, by PID; remove its config
#   tests/slurm/cluster.sh status    sinfo
#
# Two "nodes" on one host: tf1 (127.0.0.1:6818) and tf2 (127.0.0.2:6819), each a slurmd started with
# -N NAME, each with 2 fake GPUs (character devices /dev/tokenfarm-gpu*, copies of /dev/null) as gres.
# A 2-node allocation then runs one task per "node", so `srun torchrun --nnodes 2` is a real
# two-agent c10d rendezvous. A second partition, `short`, has a 2-minute MaxTime. Memory is scheduled
# (CR_Core_Memory, DefMemPerCPU), there is no
# slurmdbd (so no accounts; Snakemake's profile must use `squeue` as the status command), and
# slurm.conf lives at /etc/slurm/slurm.conf, where every SLURM command finds it without SLURM_CONF.
# Everything here is bounded by `timeout -s KILL`; state and logs live in $TF_SLURM_STATE.
set -euo pipefail

STATE=${TF_SLURM_STATE:-/tmp/tokenfarm-slurm}
CONF=/etc/slurm
NODES=(tf1 tf2)
ADDRS=(127.0.0.1 127.0.0.2)
PORTS=(6818 6819)
CPUS=${TF_SLURM_CPUS:-2}      # per node: the host's cores are shared by both "nodes"
MEM_MB=${TF_SLURM_MEM_MB:-20000}  # per node, more than the host has: nothing enforces it (no cgroups)

STARTING=
die() { echo "cluster.sh: $*" >&2; [ -z "$STARTING" ] || stop quiet; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it installs packages and writes /etc/slurm)"; }

install() {
  need_root
  if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die "apt-get not found: install slurm-wlm and munge by hand"
  timeout -s KILL 300 apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout -s KILL 600 apt-get install -y -qq slurm-wlm munge >/dev/null
}

ours() { [ ! -e "$CONF/slurm.conf" ] || grep -q "^# written by tokenfarm" "$CONF/slurm.conf"; }

write_conf() {
  ours || die "$CONF/slurm.conf exists and was not written by this script: not touching a real cluster's config"
  mkdir -p "$CONF" "$STATE"/{ctld,log}
  for n in "${NODES[@]}"; do mkdir -p "$STATE/spool-$n"; done
  local host; host=$(hostname -s)
  {
    echo "# written by tokenfarm tests/slurm/cluster.sh"
    echo "ClusterName=tokenfarm"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=6817"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "StateSaveLocation=$STATE/ctld"
    echo "SlurmdSpoolDir=$STATE/spool-%n"
    echo "SlurmctldPidFile=$STATE/slurmctld.pid"
    echo "SlurmdPidFile=$STATE/slurmd-%n.pid"
    echo "SlurmctldLogFile=$STATE/log/slurmctld.log"
    echo "SlurmdLogFile=$STATE/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "SchedulerType=sched/backfill"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core_Memory"
    echo "GresTypes=gpu"
    echo "DefMemPerCPU=1000"
    echo "MpiDefault=none"
    echo "ReturnToService=2"
    echo "SlurmdParameters=config_overrides"
    echo "SlurmctldTimeout=30"
    echo "SlurmdTimeout=30"
    echo "InactiveLimit=0"
    echo "KillWait=5"
    echo "MinJobAge=300"
    for i in "${!NODES[@]}"; do
      echo "NodeName=${NODES[$i]} NodeHostname=$host NodeAddr=${ADDRS[$i]} Port=${PORTS[$i]} CPUs=$CPUS" \
           "RealMemory=$MEM_MB Gres=gpu:2 State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
    # a cluster's time limit, shortened: the long-run rehearsal's train jobs run here (hardware.max_job_hours)
    echo "PartitionName=short Nodes=$(IFS=,; echo "${NODES[*]}") MaxTime=2 State=UP"
  } > "$CONF/slurm.conf"
  : > "$CONF/gres.conf"
  for i in "${!NODES[@]}"; do
    local a=$((2 * i)) b=$((2 * i + 1))
    for d in $a $b; do [ -e /dev/tokenfarm-gpu$d ] || mknod -m 666 /dev/tokenfarm-gpu$d c 1 3; done
    echo "NodeName=${NODES[$i]} Name=gpu File=/dev/tokenfarm-gpu[$a-$b]" >> "$CONF/gres.conf"
  done
  rm -f "$CONF/cgroup.conf"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local t=$1 what=$2; shift 2
  for _ in $(seq "$t"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  die "$what did not come up in ${t}s; logs in $STATE/log"
}

start() {
  need_root
  install
  stop quiet
  STARTING=1
  write_conf
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  # munged daemonizes and writes its pid file; run it as the munge user like the packaged unit does.
  timeout -s KILL 20 runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
  cp /run/munge/munged.pid "$STATE/munged.pid"
  wait_for 10 munged bash -c 'munge -n | unmunge'
  # -D keeps each daemon in the foreground of a background job, so $! is its PID.
  timeout -s KILL 3600 slurmctld -D -i >"$STATE/log/slurmctld.out" 2>&1 &
  echo $! > "$STATE/slurmctld.job"
  wait_for 30 slurmctld scontrol ping
  for n in "${NODES[@]}"; do
    timeout -s KILL 3600 slurmd -D -N "$n" >"$STATE/log/slurmd-$n.out" 2>&1 &
    echo $! > "$STATE/slurmd-$n.job"
  done
  wait_for 60 "the nodes" bash -c "[ \"\$(sinfo -h -N -o %T | sort -u)\" = idle ]"
  STARTING=
  sinfo -N -o "%N %T %c %m %G"
}

stop() {
  local f pid
  # Jobs first (their slurmstepd outlive slurmd), while slurmctld still answers.
  if alive "$STATE/slurmctld.job" 2>/dev/null; then timeout -s KILL 10 scancel --full -u root 2>/dev/null || true; sleep 1; fi
  for f in "$STATE"/slurmd-*.job "$STATE"/slurmctld.job "$STATE"/munged.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 10); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
  # Our config goes too: with a slurm.conf naming a controller that is down, every SLURM client
  # (and so Snakemake's SLURM plugin, which runs `scontrol show config` when it loads) waits ~9 s.
  if [ -e "$CONF/slurm.conf" ] && ours; then rm -f "$CONF/slurm.conf" "$CONF/gres.conf"; fi
  [ "${1:-}" = quiet ] || echo "cluster.sh: stopped"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) sinfo -N -o "%N %T %c %m %G" ;;
  *) die "usage: $0 install|start|stop|status" ;;
esac
