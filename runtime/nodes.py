"""Where each rank runs, so that a rank that loses its connection to a peer can name the node it
lost. Across machines the survivors' errors are gloo's ("Connection closed by peer
[10.0.0.2]:40117"): this maps the address back to the node and its ranks."""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

import torch.distributed as dist

PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


@dataclass(frozen=True)
class Place:
    rank: int
    node: int       # torchrun's node rank (GROUP_RANK)
    address: str    # the address this node reaches the rendezvous from


def local_address() -> str:
    """The address this machine uses towards the rendezvous host (a UDP "connect" sends nothing)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def gather_places() -> list[Place]:
    """Every rank's place, on every rank (one small all-gather after the process group starts)."""
    mine = Place(rank=dist.get_rank(), node=int(os.environ.get("GROUP_RANK", "0")), address=local_address())
    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, mine)
    return places


def lost_node(cause: str, places: list[Place], rank: int) -> str | None:
    """'node N (ADDRESS, ranks a, b)' for the peer address in a lost-connection error, when it is
    another node's; None otherwise (one node, or no address in the message)."""
    own = next((p.node for p in places if p.rank == rank), None)
    for address in PEER_ADDRESS.findall(cause):
        nodes = sorted({p.node for p in places if p.address == address and p.node != own})
        if len(nodes) == 1:
            ranks = [p.rank for p in places if p.node == nodes[0]]
            return f"node {nodes[0]} ({address}, ranks {', '.join(map(str, ranks))})"
    return None
