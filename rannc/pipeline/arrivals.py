"""Which of a rank's sends have certainly arrived, known from what it receives.

A gloo `isend` keeps its tensor until its work is waited for and dropped (the work never
reports itself complete before `wait`), so a call that waits for its sends only at its end
holds every microbatch's sent activations and input gradients: under 1F1B with M microbatches
a stage would keep M microbatches of outputs where its schedule keeps `in_flight` of them
alive (Llama-3-8B's stages on 32 microbatches: gigabytes the memory model does not count).

The schedule says when each message is taken: rank r takes the inputs of stage t's microbatch
m at the latest in F(t, m), the gradients of stage g's outputs at the latest in B(g, m), and
r's line runs its actions in order. So when this rank receives from r a message that r sends
in an action after the one that takes one of our messages, that message has arrived: its
`wait` returns at once, and the send can be dropped. The first message proving it is usually
the gradient coming back for the same microbatch (a forward send), or the next forward input
from upstream (a gradient send): the sends a stage holds are then what its schedule keeps in
flight. Messages taken outside the lines (model outputs and input gradients for their owners,
a late pass's) are never proven here and wait for the call's end, as before.

Pure (the schedule and the routes only): tested without a process group.

Index conventions: s, t, g stages; m microbatches; a lane is one rank's line of actions.
"""

from __future__ import annotations

from rannc.pipeline.routes import OWNERS, Routes
from rannc.pipeline.transport import Key, Kind
from rannc.schedule import Op, Schedule

Moment = tuple[int, int]  # (lane, index of an action in the lane's line)


class Arrivals:
    """For a deployment's schedule and routes: whether a received message proves a sent one
    arrived (`proves`)."""

    def __init__(self, schedule: Schedule, routes: Routes) -> None:
        self.routes = routes
        self._at: dict[tuple[Op, int, int], Moment] = {}  # (op, stage, micro) -> its moment
        for d, acts in enumerate(schedule.actions):
            for i, a in enumerate(acts):
                self._at.setdefault((a.op, a.stage, a.micro), (d, i))

    def taken(self, key: Key) -> Moment | None:
        """The latest moment its receiver takes the message `key` (None: outside the lines)."""
        if key.kind is Kind.FWD:
            return self._at.get((Op.F, key.stage, key.micro))
        if key.kind is Kind.GRAD:
            g = self.routes.supplier(key.value, key.stage)
            return None if g == OWNERS else self._at.get((Op.B, g, key.micro))
        return None  # model outputs and their gradients: taken by their owners after the line

    def sent(self, key: Key) -> Moment | None:
        """The earliest moment its sender sends the message `key` (None: not from a line)."""
        if key.kind is Kind.FWD:
            g = self.routes.supplier(key.value, key.stage)
            return None if g == OWNERS else self._at.get((Op.F, g, key.micro))
        if key.kind is Kind.GRAD:
            return self._at.get((Op.B, key.stage, key.micro))
        return None

    def proves(self, sent: Key, received: Key) -> bool:
        """Whether receiving `received` from a rank proves that our message `sent` to that same
        rank has arrived: the rank takes `sent` in an action of its line before the one in which
        it sends `received`."""
        then = self.sent(received)
        return then is not None and self.taken_before(sent, then)

    def taken_before(self, sent: Key, then: Moment) -> bool:
        """Whether message `sent` is taken in the same line before moment `then` (`proves`, with
        the received message's moment looked up once for all the sends it may prove)."""
        taken = self.taken(sent)
        return taken is not None and taken[0] == then[0] and taken[1] < then[1]


__all__ = ["Arrivals"]
