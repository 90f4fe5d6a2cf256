"""The pipeline's routes (where each value goes) and the transport's message keys, without a
process group: a captured model with a skip connection and a dead branch cut into three stages,
the tags of every key a deployment can use, and the row pieces a rank sends itself."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rannc.atomic.components import atomic_components
from rannc.errors import RaNNCError
from rannc.graph.capture import capture
from rannc.graph.extract import split_graph
from rannc.graph.task_graph import Value, ValueKind
from rannc.pipeline import transport as tp
from rannc.pipeline.routes import OWNERS, Routes
from rannc.pipeline.transport import MAX_TAG, Channel, Guess, Key, Kind, LayoutChanged, Tags, Transport

pytestmark = pytest.mark.layer("pure")


class Skip(nn.Module):
    """Three linear layers, the first's output also added before the third (a skip connection
    over the middle), a branch no output uses, and the logits returned beside the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.dead = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.relu(self.l1(x))
        b = torch.relu(self.l2(a))
        self.dead(b)  # computed, read by nothing
        logits = self.l3(a + b)
        return F.cross_entropy(logits, y), logits


@functools.cache
def routes(n_stages: int = 3) -> Routes:
    torch.manual_seed(0)
    model = Skip()
    cap = capture(copy.deepcopy(model), (torch.randn(6, 4), torch.randint(0, 3, (6,))), {})
    atomic = atomic_components(cap.graph)
    n = len(atomic.components)
    bounds = [round(i * n / n_stages) for i in range(n_stages + 1)]
    groups = [list(range(bounds[i], bounds[i + 1])) for i in range(n_stages)]
    return Routes(cap.graph, split_graph(cap.graph, atomic, groups))


def test_every_moved_input_has_one_supplier_that_computes_it() -> None:
    r = routes()
    g = r.graph
    assert len(r.stages) == 3
    for t, st in enumerate(r.stages):
        for v in st.inputs:
            if not r.moves(v):
                assert g.values[v].kind not in (ValueKind.INPUT, ValueKind.ACTIVATION) \
                    or g.values[v].batch_dim is None
                continue
            if r.shape_only(v, t):
                continue
            s = r.supplier(v, t)
            if g.values[v].kind is ValueKind.INPUT:
                assert s == OWNERS
            else:
                assert 0 <= s < t and v in r.stages[s].outputs
            assert t in r.consumers(v, s)
    # consumers is exactly the inverse of supplier
    pairs = {(v, t) for t, st in enumerate(r.stages) for v in st.inputs
             if r.moves(v) and not r.shape_only(v, t)}
    for v, t in pairs:
        assert r.consumers(v, r.supplier(v, t)).count(t) == 1


def test_the_skip_connection_reaches_the_last_stage_from_the_first() -> None:
    r = routes()
    # some value of stage 0 is read by stage 2 directly (a + b: a comes from stage 0)
    assert 0 in r.stage_suppliers()[2] or 1 in r.stage_suppliers()[2]
    assert r.stage_suppliers()[0] == []
    for t, sup in enumerate(r.stage_suppliers()):
        assert all(s < t for s in sup)


def test_outputs_and_gradient_edges() -> None:
    r = routes()
    g = r.graph
    loss, logits = (v for v in g.outputs if v is not None)
    assert r.out_stage[loss] == r.out_stage[logits] == 2
    assert r.scalar_outputs() == [loss]
    assert r.one_scalar_loss() and r.has_batch_grad_outputs()
    # gradients come back only along float values, activations and model inputs apart
    for v, t in r.grad_edges | r.input_edges:
        assert r.is_float(v) and r.moves(v) and v in r.stages[t].inputs
    assert all(r.is_activation(v) for v, _t in r.grad_edges)
    assert all(g.values[v].kind is ValueKind.INPUT for v, _t in r.input_edges)
    # the labels are integers: never a gradient edge
    labels = [v for v in g.inputs if not r.is_float(v)]
    assert labels and not any(v in labels for v, _t in r.grad_edges | r.input_edges)
    # a model input sends its gradient back only in calls where it requires grad
    for v, t in r.input_edges:
        assert not r.sends_grad_back(v, t, frozenset())
        assert r.sends_grad_back(v, t, frozenset({v}))


class SideTower(nn.Module):
    """A batch output, and an auxiliary loss from a tower of its own computed first."""

    def __init__(self) -> None:
        super().__init__()
        self.side1, self.side2 = nn.Linear(4, 4), nn.Linear(4, 1)
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.tanh(self.side1(x))
        h = self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))
        return h, self.side2(s).pow(2).mean()


def test_gradient_edges_follow_the_outputs_a_backward_is_seeded_from() -> None:
    """A backward seeded from some outputs sends gradients only along the edges they depend
    on: a tower feeding only the auxiliary loss gets none back when the step leaves that loss
    out (its parameters keep .grad None; zeros would let weight decay and momentum move them),
    and all of them when both outputs are back-propagated."""
    model = SideTower()
    cap = capture(copy.deepcopy(model), (torch.randn(6, 4),), {})
    atomic = atomic_components(cap.graph)
    n = len(atomic.components)
    r = Routes(cap.graph, split_graph(cap.graph, atomic, [list(range(n // 2)),
                                                          list(range(n // 2, n))]))
    out, aux = (v for v in cap.graph.outputs if v is not None)
    assert r.out_stage[aux] == 1  # (the tower's head on the second stage, the tower on the first)
    both = r.grad_edges_from(frozenset({out, aux}))
    assert both == r.grad_edges and len(both) >= 2
    only_out = r.grad_edges_from(frozenset({out}))
    only_aux = r.grad_edges_from(frozenset({aux}))
    assert only_out and only_aux and only_out | only_aux == both
    assert not only_out & only_aux  # the tower's output travels for the auxiliary loss alone
    assert r.grad_edges_from(frozenset()) == frozenset()


def test_channels_cover_every_route_once() -> None:
    r = routes()
    ch = r.channels()
    assert len(ch) == len(set(ch))
    for t, st in enumerate(r.stages):
        for v in st.inputs:
            if r.moves(v):
                assert (Channel(v, Kind.FWD, t) in ch) != r.shape_only(v, t)
    for v, t in r.grad_edges | r.input_edges:
        assert Channel(v, Kind.GRAD, t) in ch
    logits = [v for v in r.out_stage if r.graph.values[v].batch_dim is not None]
    for v in logits:
        assert Channel(v, Kind.OUT, 2) in ch and Channel(v, Kind.OUT_GRAD, 2) in ch


class TokenLoss(nn.Module):
    """Per-token logits and a loss, called as Hugging Face models often are, with the same
    tensor as the ids and the labels: torch.export then reads the data through one name and the
    batch size (`b, s = ids.shape`) through the other, by a task with no other input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.l1, self.l2 = nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 11)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        h = torch.relu(self.l1(self.emb(ids))).reshape(b * s, -1)
        return F.cross_entropy(self.l2(h), labels.flatten())


def test_a_stage_reading_a_value_only_for_its_sizes_gets_no_rows_of_it() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (6, 5))
    cap = capture(TokenLoss(), (ids, ids), {})
    atomic = atomic_components(cap.graph)
    n = len(atomic.components)
    r = Routes(cap.graph, split_graph(cap.graph, atomic, [list(range(n // 2)), list(range(n // 2, n))]))
    sized = [v for v in cap.graph.inputs if r.shape_only(v, 0)]
    assert len(sized) == 1, "the batch size read through one name, in the first stage"
    v = sized[0]
    other = next(u for u in cap.graph.inputs if u != v)
    assert not r.shape_only(other, 0) and not any(r.shape_only(other, t) for t in (0, 1))
    # no message carries v's rows or a gradient for it; the data's name still travels
    ch = r.channels()
    assert not [c for c in ch if c.value == v]
    assert r.consumers(v, OWNERS) == [] and r.consumers(other, OWNERS) != []
    assert all(u != v for u, _t in r.grad_edges | r.input_edges)
    # the stage gets a stand-in of v's shape for the rows asked for, one element of storage
    t = Transport(0, Tags(ch, 2), cap.graph.values, torch.device("cpu"))
    s = t.stand_in(v, 3)
    assert s.shape == (3, 5) and s.dtype == ids.dtype
    assert s.untyped_storage().nbytes() == ids.element_size()


def test_tags_are_distinct_for_distinct_keys() -> None:
    r = routes()
    M = 5
    tags = Tags(r.channels(), M)
    keys = [Key(c.value, m, c.kind, c.stage) for c in r.channels() for m in range(M)]
    got = [tags(k) for k in keys]
    assert len(set(got)) == len(keys)
    assert all(0 <= x <= MAX_TAG for x in got)
    with pytest.raises(KeyError):
        tags(Key(keys[0].value, M, keys[0].kind, keys[0].stage))  # no such microbatch


def test_one_value_read_by_two_stages_of_one_rank_gets_two_tags() -> None:
    """Interleaved schedules put non-adjacent stages on one rank: a value two of them read
    travels twice between the same two ranks, and the tags must tell the copies apart (the
    old value-microbatch-kind tag gave both the same)."""
    chans = [Channel("x", Kind.FWD, 1), Channel("x", Kind.FWD, 3), Channel("x", Kind.GRAD, 1)]
    tags = Tags(chans, 4)
    assert tags(Key("x", 2, Kind.FWD, 1)) != tags(Key("x", 2, Kind.FWD, 3))
    assert tags(Key("x", 2, Kind.FWD, 1)) != tags(Key("x", 2, Kind.GRAD, 1))


def test_too_many_keys_are_refused_with_the_numbers() -> None:
    chans = [Channel(f"v{i}", Kind.FWD, 0) for i in range(1000)]
    with pytest.raises(RaNNCError, match="1000 channels"):
        Tags(chans, 2**22)


def _values() -> dict[str, Value]:
    # x: rows in dim 0; s: two tensor rows per sample in dim 1 (batch_scale 2)
    return {"x": Value("x", ValueKind.ACTIVATION, ("batch", 3), "float32", batch_dim=0),
            "s": Value("s", ValueKind.ACTIVATION, (5, "2*batch"), "float32", batch_dim=1,
                       batch_scale=2)}


def test_pieces_sent_to_this_rank_come_back_as_the_rows_asked_for() -> None:
    tags = Tags([Channel("x", Kind.FWD, 1), Channel("s", Kind.FWD, 1)], 2)
    t = Transport(0, tags, _values(), torch.device("cpu"))
    x = torch.arange(18.0).reshape(6, 3)  # rows 4..9 of the global batch
    # this rank holds rows 4..9 and asks for rows 6..8; the rest would go to rank 0 too but
    # another key
    t.send_rows(x, Key("x", 1, Kind.FWD, 1), (4, 10), [(0, (6, 8))])
    got = t.recv_rows(Key("x", 1, Kind.FWD, 1), (6, 8), [(0, (0, 8))])
    assert torch.equal(got, x[2:4])
    s = torch.arange(40.0).reshape(5, 8)  # 4 samples x 2 rows in dim 1: samples 0..3
    t.send_rows(s, Key("s", 0, Kind.FWD, 1), (0, 4), [(0, (1, 3))])
    assert torch.equal(t.recv_rows(Key("s", 0, Kind.FWD, 1), (1, 3), [(0, (0, 4))]), s[:, 2:6])
    assert t.empty("s", 3).shape == (5, 6)


class _Agreement:
    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def ready(self) -> bool:
        return False

    def resolve(self) -> list[int]:
        return self.sizes


def test_a_guessed_call_holds_its_sends_back_until_the_agreement(monkeypatch: Any) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(tp.dist, "isend", lambda x, dst, tag: sent.append((dst, tag)))
    tags = Tags([Channel("x", Kind.FWD, 1)], 2)
    checked: list[bool] = []
    t = Transport(0, tags, _values(), torch.device("cpu"),
                  Guess(_Agreement([4, 4]), [4, 4], [lambda: checked.append(True)]))  # type: ignore[arg-type]
    t.send(torch.zeros(2, 3), 1, Key("x", 1, Kind.FWD, 1))
    t.poll()  # not ready: still held
    assert sent == [] and checked == []
    t.settle()
    assert sent == [(1, tags(Key("x", 1, Kind.FWD, 1)))] and checked == [True]
    t.send(torch.zeros(2, 3), 1, Key("x", 0, Kind.FWD, 1))  # settled: goes at once
    assert len(sent) == 2


def test_a_wrong_guess_sends_nothing_and_says_the_new_sizes(monkeypatch: Any) -> None:
    sent: list[int] = []
    monkeypatch.setattr(tp.dist, "isend", lambda x, dst, tag: sent.append(dst))
    t = Transport(0, Tags([Channel("x", Kind.FWD, 1)], 1), _values(), torch.device("cpu"),
                  Guess(_Agreement([4, 3]), [4, 4]))  # type: ignore[arg-type]
    t.send(torch.zeros(2, 3), 1, Key("x", 0, Kind.FWD, 1))
    with pytest.raises(LayoutChanged) as e:
        t.settle()
    assert e.value.sizes == [4, 3] and sent == []


class _Work:
    def __init__(self, buf: torch.Tensor, fill: float, log: list[str]) -> None:
        self.buf, self.fill, self.log = buf, fill, log

    def wait(self) -> None:
        self.log.append("wait")
        self.buf.fill_(self.fill)  # the data lands when the receive is waited for


def _posting(monkeypatch: Any) -> list[str]:
    """irecv fills its buffer with the source rank when waited for; recv must not be called."""
    log: list[str] = []

    def irecv(buf: torch.Tensor, src: int, tag: int) -> _Work:
        log.append(f"irecv {src} {tag} {tuple(buf.shape)}")
        return _Work(buf, float(src), log)

    def recv(buf: torch.Tensor, src: int, tag: int) -> None:
        log.append(f"recv {src}")
        buf.fill_(float(src))
    monkeypatch.setattr(tp.dist, "irecv", irecv)
    monkeypatch.setattr(tp.dist, "recv", recv)
    return log


def test_a_receive_posted_ahead_is_taken_by_recv_rows_in_row_order(monkeypatch: Any) -> None:
    """`expect` posts one irecv per remote piece at once; `recv_rows` then waits for those
    (no blocking recv) and assembles them with this rank's own piece in row order."""
    log = _posting(monkeypatch)
    tags = Tags([Channel("x", Kind.FWD, 1)], 2)
    t = Transport(1, tags, _values(), torch.device("cpu"))
    key = Key("x", 0, Kind.FWD, 1)
    src = [(0, (0, 2)), (1, (2, 3)), (2, (3, 6))]  # rows 0..6 from ranks 0, 1 (this one), 2
    t.expect(key, (1, 5), src)
    assert log == [f"irecv 0 {tags(key)} (1, 3)", f"irecv 2 {tags(key)} (2, 3)"]
    t.send(torch.full((1, 3), 1.0), 1, key)  # this rank's own row 2, handed over in memory
    got = t.recv_rows(key, (1, 5), src)
    assert got[:, 0].tolist() == [0.0, 1.0, 2.0, 2.0]
    assert log[2:] == ["wait", "wait"]
    t.check_drained()


def test_nothing_is_posted_twice_on_a_guess_or_for_this_rank_alone(monkeypatch: Any) -> None:
    log = _posting(monkeypatch)
    tags = Tags([Channel("x", Kind.FWD, 1)], 2)
    t = Transport(0, tags, _values(), torch.device("cpu"),
                  Guess(_Agreement([4, 4]), [4, 4]))  # type: ignore[arg-type]
    k0, k1 = Key("x", 0, Kind.FWD, 1), Key("x", 1, Kind.FWD, 1)
    t.expect(k0, (0, 2), [(1, (0, 4))])  # a guessed layout: its rows may change
    assert log == []
    t.settle()
    t.expect(k0, (0, 2), [(0, (0, 4))])  # all from this rank: nothing to post
    assert log == []
    t.expect(k0, (0, 2), [(1, (0, 4))])
    t.expect(k0, (0, 2), [(1, (0, 4))])  # already posted
    assert len(log) == 1
    t.recv_rows(k0, (0, 2), [(1, (0, 4))])
    t.expect(k0, (0, 2), [(1, (0, 4))])  # already received in this call
    t.expect(k1, (0, 2), [(1, (0, 4))])
    assert [e.split()[0] for e in log] == ["irecv", "wait", "irecv"]
    with pytest.raises(RaNNCError, match="posted and never taken"):
        t.check_drained()  # k1 was posted and never received
