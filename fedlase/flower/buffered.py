"""FedBuff and FedAsync on Flower (`schedule=fedbuff|fedasync`, engine=flower-deploy; docs/async.md,
docs/flower.md): the event loop of fedlase/asynchronous.py with the nodes' replies for arrivals, over Flower's
Message API.

The ServerApp keeps `concurrency` clients training: it pushes one TRAIN message to each chosen client's node
(`Grid.push_messages`; the message `NodeRounds.messages` builds for a synchronous round, with the batches of the
round the client was drawn in and its level's submodel of the current model version), and pulls replies
(`Grid.pull_messages`) until one is there. Every reply is an arrival, delivered one at a time, in the order the
ServerApp received them (replies of one pull in the order their nodes made them, `created_at`). After `buffer`
arrivals (fedasync: every arrival) the server steps exactly as the embedded schedule does
(`AsyncSchedule._apply`: the staleness weights, then `Experiment.serve`: the screen and the rule), then refills
the freed slots from the new version, drawing clients in the synchronous rounds' order (`AsyncSchedule._fill`).
Staleness: the server steps between the version a message carried and the step that applies its reply.

A reply that is an error, fails the wire's checks (`NodeRounds.update_from`), or does not come within `reply_timeout`
seconds, and a client no node holds, frees its slot and is dropped (`failed` in the step's metrics line, the
reason in the record). The run's `arrivals.jsonl` records every arrival (fedlase/asynchronous.py), its time as
`wall_time` (seconds since the first message); `schedule_args.replay` on the embedded engine rebuilds the run
from it, bit for bit on the same machine.

What Flower 1.42 cannot do here: it offers no notice of a reply, so arrivals are seen at the ServerApp's pulls
(`NodeRounds.POLL`, 0.2 s) and replies that come within one pull are ordered by their nodes' clocks; and a pushed
message cannot be withdrawn, so a message whose reply is given up (or still out when the run ends) keeps its node
busy until it is done. The messages in flight are the SuperLink's, not the checkpoint's: such a run cannot be
resumed."""
from __future__ import annotations

import dataclasses
import heapq
import logging
import time

from ..asynchronous import AsyncSchedule, Flight, ServerPort, by_draw, credited
from ..errors import UserError
from ..masks import Submodel
from .codec import ReplyError

log = logging.getLogger("fedlase")


class NodeSchedule(AsyncSchedule):
    """`schedule=fedbuff|fedasync` on Flower nodes; `nodes`: the ServerApp's NodeRounds (discovery, pins, checks)."""

    TIME = "wall_time"

    def __init__(self, cfg, nodes):
        super().__init__(cfg)
        self.nodes = nodes
        self.start: float | None = None   # time.monotonic() at the first dispatch
        # message id -> (its flight, NodeRounds.messages' entry, the submodel the update is credited with,
        # when it is given up)
        self.sent: dict[str, tuple[Flight, tuple, Submodel, float]] = {}
        self.ready: list[Flight] = []     # arrived (or failed at once), not yet delivered, in order

    def _wall(self) -> float:
        if self.start is None:
            self.start = time.monotonic()
        return time.monotonic() - self.start

    def _dispatch(self, exp: ServerPort, client: int, level: int) -> tuple[float, bool]:
        return self._wall(), False   # when it was sent: its arrival is whenever its reply comes

    def _launch(self, exp: ServerPort, trainees: list[Flight], subs: dict) -> None:
        """Push one TRAIN message per dispatched client (its draw's batches, its level's submodel)."""
        stripped: dict[int, Submodel] = {}
        for draw, group, picked in by_draw(exp, trainees):
            entries = self.nodes.messages(exp, draw, picked, {lv: subs[lv] for _, lv in picked})
            pushed = [f for f in group if f.client in entries]
            ids = list(self.nodes.grid.push_messages([entries[f.client][0] for f in pushed])) if pushed else []
            ids += [None] * (len(pushed) - len(ids))   # a push refused whole (too large) returns none
            give_up = time.monotonic() + self.nodes.reply_timeout
            for f in group:
                if f.client not in entries:
                    self._drop(f, "no node holds its partition")
            for f, mid in zip(pushed, ids):
                if not mid:
                    self._drop(f, "Flower could not push its message")
                    continue
                entry = entries[f.client]   # entry[2]: its submodel, credited as the embedded schedule's
                self.sent[mid] = (f, entry, credited(entry[2], stripped), give_up)

    def _drop(self, f: Flight, why: str) -> None:
        log.warning("client %d (dispatch %d): %s; its slot is free again", f.client, f.seq, why)
        f.failed = why
        self.ready.append(f)

    def _arrivals(self, exp: ServerPort) -> list[Flight]:
        """The next reply (or failure), as one arrival: pulled every POLL seconds until there is one."""
        while not self.ready:
            if not self.sent:   # cannot happen while a slot is taken; a loop waiting on nothing would never end
                raise UserError(f"schedule={self.kind}: no message is out and no reply is waiting")
            self._pull(exp)
            if not self.ready:
                time.sleep(self.nodes.POLL)
        f = self.ready.pop(0)
        self.flight.remove(f)
        heapq.heapify(self.flight)
        self.now = f.arrival = self._wall()
        return [f]

    def _pull(self, exp: ServerPort) -> None:
        """The replies there are now into `ready` (checked: an update, or why it failed), and the messages past
        their reply_timeout given up."""
        if self.sent:
            got = [m for m in self.nodes.grid.pull_messages(list(self.sent))
                   if m.metadata.reply_to_message_id in self.sent]
            got.sort(key=lambda m: (m.metadata.created_at, self.sent[m.metadata.reply_to_message_id][0].seq))
            for reply in got:
                f, entry, sub, _ = self.sent.pop(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    self._drop(f, f"node error: {reply.error.reason}")
                    continue
                try:
                    u = self.nodes.update_from(exp, f.draw, f.client, entry, reply)
                except ReplyError as e:
                    self._drop(f, f"reply rejected: {e}")
                    continue
                f.update = dataclasses.replace(u, sub=sub)
                self.ready.append(f)
        now = time.monotonic()
        for mid, (f, _, _, give_up) in list(self.sent.items()):
            if now > give_up:
                del self.sent[mid]
                self._drop(f, f"no reply within reply_timeout={self.nodes.reply_timeout:g}s")

    def _stats(self) -> dict:
        return self.nodes.take_events()

    def load_state_dict(self, state: dict, exp: ServerPort, Update) -> None:
        raise UserError(f"resume: a {self.kind} run on Flower cannot resume: the messages it had in flight were the "
                        "SuperLink's, and are gone; start it again in another out folder")
