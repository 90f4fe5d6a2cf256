"""Run on every rank by tests/test_dist_bootstrap.py: bootstrap rannc.dist and exercise it.

Checks the identity against the launcher's environment, then an all_reduce, a send/recv ring
and all_reduces in two subgroups, and prints ``OK rank R of W local L backend B launcher X``.
``--fail-rank R`` makes rank R raise before the first collective (the others must not hang).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as tdist

from rannc import dist


def expected_identity(launcher: str) -> tuple[int, int, int]:
    """(rank, world size, local rank) as the launcher announced them in the environment."""
    env = os.environ
    if launcher == "torchrun":
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if launcher == "mpi":
        rank = int(env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK", env.get("PMIX_RANK", "-1"))))
        size = int(env.get("PMI_SIZE", env.get("OMPI_COMM_WORLD_SIZE", "-1")))
        local = int(env.get("MPI_LOCALRANKID", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "-1")))
        return rank, size, local
    return 0, 1, 0


def listening_addresses() -> list[str]:
    """The local addresses of this process's listening TCP sockets (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/self/net/tcp", 8), ("/proc/self/net/tcp6", 32)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, port = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            import ipaddress
            addr = ipaddress.ip_address(words if width == 32 else words[:4])
            found.append(f"{addr}:{int(port, 16)}")
    return found


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument("--expect-launcher", default=None)
    ap.add_argument("--fail-rank", type=int, default=None)
    ap.add_argument("--hang-rank", type=int, default=None)
    ap.add_argument("--check-listen", action="store_true")
    ap.add_argument("--exit-without-shutdown", action="store_true",
                    help="leave the groups to rannc's exit handler; say whether it destroyed them")
    a = ap.parse_args(argv)
    if a.exit_without_shutdown:
        import atexit

        # (registered before rannc's: atexit runs handlers last-in first-out, so this one after)
        atexit.register(lambda: sys.stdout.write(
            f"EXIT rank {dist.get_rank()} groups destroyed {not tdist.is_initialized()}\n"))

    preexisting: set[str] = set()
    if a.check_listen:
        # The launcher's and MPI's own sockets (Hydra's PMI port, MPICH's netmod) are not ours:
        # initialise MPI first and look only at what rannc's rendezvous and gloo open after it.
        if dist.detect_launcher() == "mpi":
            from mpi4py import MPI

            MPI.COMM_WORLD.Barrier()
        preexisting = set(listening_addresses())
    before = (dist.get_rank(), dist.get_world_size(), dist.get_local_rank())
    ctx = dist.init_process_group(timeout_s=a.timeout_s)
    check(dist.init_process_group() is ctx, "init_process_group is not idempotent")
    if a.expect_launcher is not None:
        check(ctx.launcher == a.expect_launcher, f"launcher {ctx.launcher!r} != {a.expect_launcher!r}")
    rank, world, local = ctx.rank, ctx.world_size, ctx.local_rank
    exp = expected_identity(ctx.launcher)
    check((rank, world, local) == exp, f"(rank, world, local) {(rank, world, local)} != env {exp}")
    check(before == exp, f"env-only identity before init {before} != {exp}")
    check((dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == exp, "getters after init")
    check(ctx.backend == os.environ.get("RANNC_BACKEND", ctx.backend), f"backend {ctx.backend}")
    check(1 <= ctx.local_world_size <= world and 0 <= local < ctx.local_world_size, f"local {ctx}")

    if a.fail_rank == rank:
        raise RuntimeError(f"rank {rank} fails on purpose before the first collective")
    if a.hang_rank == rank:
        time.sleep(3600)  # stuck without closing its sockets: the others must time out

    dev = ctx.device
    # all_reduce over the world: sum of (rank + 1).
    t = torch.full((4,), float(rank + 1), device=dev)
    tdist.all_reduce(t)
    check(bool(torch.all(t == world * (world + 1) / 2)), f"all_reduce gave {t.tolist()}")

    # Ring: send to the right neighbour, receive from the left one.
    if world > 1:
        right, left = (rank + 1) % world, (rank - 1) % world
        send = torch.full((3,), float(rank), device=dev)
        recv = torch.empty(3, device=dev)
        reqs = [tdist.isend(send, right), tdist.irecv(recv, left)]
        for r in reqs:
            assert r is not None  # None only for ranks outside the (default) group
            r.wait()
        check(bool(torch.all(recv == float(left))), f"ring received {recv.tolist()} expected {left}")

    # Two subgroups (halves of the world), created in the same order on every rank.
    half = (world + 1) // 2
    specs = [list(range(half)), list(range(half, world))] if world > 1 else [[0], [0]]
    groups = [dist.new_group(list(reversed(s))) for s in specs]  # unsorted on purpose
    for spec, g in zip(specs, groups, strict=True):
        check(dist.new_group(spec) is g, f"new_group({spec}) not cached")
        if rank not in spec:
            check(g is None, f"non-member got a group for {spec}")
            continue
        check(g is not None, f"member got no group for {spec}")
        s = torch.ones(2, device=dev)
        tdist.all_reduce(s, group=g)
        check(bool(torch.all(s == len(spec))), f"subgroup {spec} all_reduce gave {s.tolist()}")

    dist.barrier()
    if a.check_listen:
        # Every socket this rank listens on -- rannc's store (rank 0), gloo's pairs -- must be
        # on loopback when all ranks share one node.
        import ipaddress

        addrs = sorted(set(listening_addresses()) - preexisting)
        sys.stdout.write(f"LISTEN rank {rank} {' '.join(addrs) or '-'}\n")
        check(all(ipaddress.ip_address(x.rsplit(":", 1)[0]).is_loopback for x in addrs),
              f"listening beyond loopback: {addrs}")
    # One write, newline included: print() writes the text and the newline separately, and
    # mpiexec then interleaves the ranks' lines ("...launcher mpiOK rank 2...").
    line = f"OK rank {rank} of {world} local {local} backend {ctx.backend} launcher {ctx.launcher}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if a.exit_without_shutdown:
        return 0
    dist.shutdown()
    check(not tdist.is_initialized(), "shutdown left the process group initialized")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
