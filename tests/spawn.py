"""Run a test's worker on several gloo ranks in spawned processes: ``target(rank, world, port, *args)``."""
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, world: int, *args, timeout: float = 300) -> None:
    """Starts ``world`` processes and waits for them; any nonzero exit code fails the test."""
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"worker exit code {p.exitcode}"
