"""Several "nodes" on this host: one command started once per node with the multi-node variables
(WORLD_SIZE, RANK, MASTER_ADDR=127.0.0.1 and one free MASTER_PORT), as several machines would run it."""
from __future__ import annotations

import subprocess
from typing import Mapping


def run_nodes(argv: list[str], env: Mapping[str, str], nodes: int = 2,
              timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Every node's completed process (stdout and stderr as text), in node order."""
    from deepinfer.parallel.launch import free_port

    port = str(free_port())
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "WORLD_SIZE": str(nodes), "RANK": str(node),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for node in range(nodes)]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done
