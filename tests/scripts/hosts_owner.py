"""A pool on 2 emulated hosts that the test kills (SIGKILL) or interrupts (SIGINT).

Prints one JSON line (the keeper's, the namespace holders' and the ranks' pids, the namespaces'
inodes), then runs a task that sleeps for a minute.
"""

import json
import os
import time

import lab


def sleep(mesh: lab.Mesh, seconds: float) -> None:
    time.sleep(seconds)


if __name__ == "__main__":
    with lab.launch(4, hosts=2, link_gbit=1.0, transport="tcp") as cluster:
        hosts = cluster.hosts
        paths = [hosts.switch_netns] + [h.netns for h in hosts.hosts]
        print(json.dumps({
            "pids": hosts.pids + cluster.pids,
            "inodes": [os.stat(p).st_ino for p in paths],}), flush=True)
        cluster.run(sleep, 60.0)
