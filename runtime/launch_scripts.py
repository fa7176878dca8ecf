"""Launching a plan on machines this one does not manage: torchrun per host of a hostfile, and a
Kubernetes PyTorchJob (Kubeflow training operator). Both start the same worker as `planner run`
(runtime.worker, the plan's own flags), with torchrun's c10d rendezvous on the first node; paths
in the worker's arguments (the plan, --out, --checkpoint-dir) must be on storage every node sees.
SLURM's script and the per-node commands are runtime.launch's.
"""
from __future__ import annotations

import socket
from pathlib import Path

import yaml

from costmodel.inputs import UserError, read_text
from costmodel.plan import PlanFile
from runtime.launch import C10D_HOST_ORDER, PORT, WorkerArgs, domain_hosts, job_name, launch_env, node_commands


def read_hostfile(path: Path, pf: PlanFile) -> list[str]:
    """One host per line (`host` or MPI's `host slots=N`; `#` comments): as many hosts as the
    plan's (ClusterSpec.launch_hosts: its nodes, or their hosts where a node is an NVLink domain of
    several), each with that many devices, each name resolvable here."""
    count, per_host = pf.cluster.launch_hosts
    text = read_text(path, "hostfile")
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].split()
        if not line:
            continue
        host, *rest = line
        for field in rest:
            key, _, value = field.partition("=")
            if key != "slots" or not value.isdigit():
                raise UserError(f"hostfile {path}:{number}: {field!r} is not slots=N")
            if int(value) != per_host:
                raise UserError(f"hostfile {path}:{number}: {host} has slots={value}, but the plan puts "
                                 f"{per_host} ranks on every host")
        hosts.append(host)
    if len(hosts) != count:
        raise UserError(f"hostfile {path}: {len(hosts)} host(s), but the plan's cluster has {count} host(s)")
    if len(set(hosts)) != len(hosts):
        twice = next(h for h in hosts if hosts.count(h) > 1)
        raise UserError(f"hostfile {path}: {twice} is listed twice; each line is a host of its own")
    _check_domains_sort_together(path, hosts, domain_hosts(pf.cluster))
    for host in hosts:
        try:
            socket.getaddrinfo(host, PORT)
        except OSError:
            raise UserError(f"hostfile {path}: host {host!r} cannot be resolved from here") from None
    return hosts


def _check_domains_sort_together(path: Path, hosts: list[str], hosts_per_domain: int) -> None:
    """Where a node of the plan is an NVLink domain of several hosts (a GB200 NVL72 rack's trays),
    the hostfile lists each domain's hosts one after the other; c10d ranks the hosts by name
    (runtime.launch.C10D_HOST_ORDER), so the hosts of each domain must also be neighbours in that
    order, or a tensor-parallel group would span two domains over the scale-out network."""
    if hosts_per_domain == 1:
        return
    def domains(order: list[str]) -> list[frozenset[str]]:
        return [frozenset(order[i:i + hosts_per_domain]) for i in range(0, len(order), hosts_per_domain)]
    listed = {host: domain for domain in domains(hosts) for host in domain}
    for domain in domains(sorted(hosts)):
        first, *rest = sorted(domain)
        if other := next((h for h in rest if listed[h] != listed[first]), None):
            raise UserError(f"hostfile {path}: {first} and {other} would share an NVLink domain of "
                            f"{hosts_per_domain} hosts: {C10D_HOST_ORDER}; list each domain's hosts by names "
                            "or addresses that sort together")


def hostfile_commands(pf: PlanFile, worker: WorkerArgs, hosts: list[str]) -> list[str]:
    """Per host, the command to run there (over ssh, or by hand): runtime.launch's per-node
    torchrun with the first host as the rendezvous endpoint."""
    return node_commands(pf, worker, hosts)


def pytorchjob_yaml(pf: PlanFile, worker: WorkerArgs, image: str) -> str:
    """A PyTorchJob: one Master and the other hosts as Workers (ClusterSpec.launch_hosts), each a pod
    with its host's GPUs running torchrun (the operator sets MASTER_ADDR and MASTER_PORT; c10d ranks
    the pods)."""
    c = pf.cluster
    count, per_host = c.launch_hosts
    command = ["torchrun", f"--nnodes={count}", f"--nproc-per-node={per_host}",
               f"--max-restarts={worker.max_restarts}", "--rdzv-backend=c10d",
               "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)", "--rdzv-id=planner", *worker.argv()]

    def replica(replicas: int) -> dict:
        gpus = {"nvidia.com/gpu": per_host} if c.device.kind != "cpu" else {}
        container = {"name": "pytorch", "image": image, "command": command, "resources": {"limits": gpus},
                     "env": [{"name": k, "value": v} for k, v in launch_env(pf).items()]}
        return {"replicas": replicas, "restartPolicy": "OnFailure", "template": {"spec": {"containers": [container]}}}
    specs = {"Master": replica(1)}
    if count > 1:
        specs["Worker"] = replica(count - 1)
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": job_name(pf)},
           "spec": {"pytorchReplicaSpecs": specs}}
    return yaml.safe_dump(job, sort_keys=False)
