"""Ranks of one instance over gloo: the collectives, and the proof every rank gives before anything
flows (a rank without the cluster token is refused by every rank)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from xllm.common.net import free_port
from xllm.core.parallel import CollectiveError, GlooComm, GroupAddress
from xllm.core.parallel.trust import check_group_address, prove_group
from xllm.engine_api.credential import ClusterKeys
from xllm.engine_api.security import SecurityConfigError

TOKEN = "t" * 32


def _rank(rank: int, size: int, port: int, tokens: list[str | None], out) -> None:
    torch.set_num_threads(1)
    comm = GlooComm(GroupAddress("127.0.0.1", port, timeout_s=30), rank, size)
    try:
        x = torch.full((3, 5), float(rank + 1))
        comm.all_reduce(x)
        gathered = [int(t.item()) for t in comm.all_gather(torch.tensor([rank * 10]))]
        token = tokens[rank]
        try:
            prove_group(comm, ClusterKeys.from_token(token) if token else None)
            verdict = "ok"
        except CollectiveError as e:
            verdict = str(e)
        out.put((rank, x[0, 0].item(), gathered, verdict))
    finally:
        comm.close()


def _run(tokens: list[str | None]) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, len(tokens), port, tokens, out)) for r in range(len(tokens))]
    for p in procs:
        p.start()
    try:
        results = dict((r, rest) for r, *rest in (out.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


def test_collectives_and_the_rank_proof():
    good = _run([TOKEN, TOKEN, TOKEN])
    assert {r: v[0] for r, v in good.items()} == {0: 6.0, 1: 6.0, 2: 6.0}  # 1 + 2 + 3 on every rank
    assert all(v[1] == [0, 10, 20] for v in good.values())
    assert all(v[2] == "ok" for v in good.values())
    bad = _run([TOKEN, "x" * 32, TOKEN])  # rank 1 holds another token: every rank refuses the group
    # (rank 1 sees the others' answers fail against its own key)
    assert {r: v[2].split(" did not")[0] for r, v in bad.items()} == {0: "rank(s) [1]", 1: "rank(s) [0, 2]",
                                                                      2: "rank(s) [1]"}


def test_a_group_beyond_loopback_needs_the_token():
    check_group_address("127.0.0.1", None)
    check_group_address("10.0.0.5", ClusterKeys.from_token(TOKEN))
    with pytest.raises(SecurityConfigError, match=r"--master-addr 10\.0\.0\.5 is not loopback"):
        check_group_address("10.0.0.5", None)
