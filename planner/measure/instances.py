"""Cloud instances a published run names instead of stating its network.

A source that trained on a cloud often says which instance it rented ("64 p4d.24xlarge
instances") and not what network joins them; the device profiles price a DGX's (8 NICs of 200
Gbit/s for an A100, 400 for an H100). A row whose `notes` name one of these instances is priced
over the instance's network, as the optional column node_network_gbps would state it
(planner.measure.runs_table); a stated column wins, and notes naming instances of different
networks are read as naming none. Only instances whose network the provider states are here,
each with that statement. The network's bandwidth is the instance's; its per-step latency and
the fraction of nominal its collectives reach stay the profile's (InfiniBand's).
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Instance:
    name: str
    node_network_gbps: float   # the node's network to other nodes, Gbit/s, shared by its GPUs
    source: str


INSTANCES = (
    Instance("p3dn.24xlarge", 100, "AWS EC2 P3dn: 8 V100 32GB, 100 Gbit/s of EFA networking"),
    Instance("p4d.24xlarge", 400, "AWS EC2 P4d: 8 A100 40GB, 400 Gbit/s of EFA networking with GPUDirect RDMA "
             "(AWS HPC blog, 'Amazon EC2 P4d instances deep dive', 2020)"),
    Instance("p4de.24xlarge", 400, "AWS EC2 P4de: P4d's 400 Gbit/s of EFA networking, with 8 A100 80GB"),
    Instance("p5.48xlarge", 3200, "AWS EC2 P5: up to 32 network cards, 3,200 Gbit/s of EFA networking "
             "(EC2 user guide, 'Maximize network bandwidth on accelerated instances with EFA')"),
    Instance("p5e.48xlarge", 3200, "AWS EC2 P5e: P5's 3,200 Gbit/s, with 8 H200"),
)

# an instance as sources write it: the whole name, or the family alone where it names nothing else
# ("p4d", "p4de", "p3dn"; "p5" alone is too common a token to read as an instance)
_PATTERNS = tuple((i, re.compile(rf"\b{re.escape(i.name)}\b" if i.name.startswith("p5")
                                 else rf"\b{re.escape(i.name.split('.')[0])}(\.24xlarge)?\b", re.IGNORECASE))
                  for i in INSTANCES)


def instance_in_notes(notes: str) -> Instance | None:
    """The instance the notes name (None: none, or instances of different networks)."""
    named = [i for i, pattern in _PATTERNS if pattern.search(notes or "")]
    if len({i.node_network_gbps for i in named}) != 1:
        return None
    return named[0]
