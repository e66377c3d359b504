"""Which dead tensor-parallel worker an error names: one killed by a signal (the cause) before
peers that exited with errors of their own once its connections closed."""

from __future__ import annotations

import signal

from hf_paged.worker.ranks import Ranks, stage_key


class Worker:
    def __init__(self, pid: int, code: int | None):
        self.pid, self.code = pid, code

    def poll(self) -> int | None:
        return self.code


class Store:
    def __init__(self, keys: dict[str, bytes]):
        self.keys = keys

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key]


def ranks(*codes: int | None, errors: dict[int, str] | None = None) -> Ranks:
    store = Store({stage_key(r, "error"): e.encode() for r, e in (errors or {}).items()})
    return Ranks(tp=None, channel=None, groups=[], launched=False, store=store,
                 workers=[Worker(100 + r, c) for r, c in enumerate(codes, start=1)])


def test_none_dead():
    assert ranks(None, None).dead_worker() is None and ranks(None).exited() == []


def test_the_killed_rank_is_named_first_with_its_peers_after():
    dead = ranks(None, 1, -signal.SIGKILL, errors={2: "connection closed by peer"})
    message = dead.dead_worker()
    assert message.startswith("tensor-parallel worker rank 3 (pid 103) was killed by SIGKILL")
    assert " (also: rank 2 (pid 102) exited (1))" in message
    assert "connection closed" not in message  # the cause's report only, and it has none


def test_an_exit_code_alone_names_the_first_with_its_error():
    message = ranks(1, None, 2, errors={1: "Traceback: boom"}).dead_worker()
    assert message == ("tensor-parallel worker rank 1 (pid 101) exited (1) (also: rank 3"
                       " (pid 103) exited (2)); its error:\nTraceback: boom")
