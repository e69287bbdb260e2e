"""A small private network on this machine: one network namespace per "host", each joined to a
bridge by a veth pair, with addresses of our own, so Ray and UCX traffic between the hosts
crosses real interfaces. The bridge sits in the root namespace with an address too, so the
test process can reach the hosts' HTTP and dashboard ports; nothing is routed further.

Names carry a per-run id, so runs do not collide; `teardown` deletes every namespace, veth and
bridge the network made, and is safe to call twice or after a half-finished `setup`.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

SUBNET = "10.231.0"
INNER_DEVICE = "rpd0"  # the same name inside every namespace, so one UCX_NET_DEVICES fits all


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Host:
    name: str
    netns: str
    address: str
    outer: str  # the veth end on the bridge

    @property
    def prefix(self) -> list[str]:
        """Run a command on this host."""
        return ["ip", "netns", "exec", self.netns]


@dataclass
class Network:
    hosts: dict[str, Host] = field(default_factory=dict)
    bridge: str = ""
    gateway: str = f"{SUBNET}.1"

    def setup(self, names: Sequence[str]) -> None:
        tag = uuid.uuid4().hex[:4]
        self.bridge = f"rpdbr{tag}"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(names):
            host = Host(name, f"rpd-{tag}-{name}", f"{SUBNET}.{10 + i}", f"rpd{tag}h{i}")
            self.hosts[name] = host
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.outer, "type", "veth", "peer", "name", INNER_DEVICE, "netns", host.netns)
            _ip("link", "set", host.outer, "master", self.bridge)
            _ip("link", "set", host.outer, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", INNER_DEVICE)
            _ip("-n", host.netns, "link", "set", INNER_DEVICE, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")

    def teardown(self) -> None:
        """Deleting a namespace deletes its veth end, and with it the pair."""
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.outer, check=False)
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)
        self.hosts.clear()

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network that still exist (none after `teardown`)."""
        names = [h.netns for h in self.hosts.values()]
        netns = _ip("netns", "list").stdout
        links = _ip("-o", "link").stdout
        return [n for n in names if n in netns] + [x for x in (self.bridge,) if x and x in links]
