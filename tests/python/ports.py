"""A free TCP port on the loopback for a job's rendezvous. It is drawn below the kernel's ephemeral range
(32768-60999 by default), where ports bound to 0 come from: a port merely seen free there can be taken by a
connection or a listener of another job (UCX's, a bootstrap's) before the job binds it."""

import random
import socket


def free_port() -> int:
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free TCP port in 20000-32000 on 127.0.0.1")
