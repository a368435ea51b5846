"""The server side of a Flower round, as the engine's round runner (fedlase/engine.py: `RoundRunner`).

It holds no algorithm of its own: the engine samples clients, asks the method for submodels, aggregates the
updates this runner returns and calls the trackers, exactly as in the embedded engine. What it adds is the
wire: finding which node holds which partition (QUERY), one TRAIN message per node carrying that node's own
submodel, checking every reply (`codec.validate_reply`) and counting bytes.

Partitions are pinned to nodes: given `pins` (partition id -> fingerprint of the one node key allowed to serve
it, `security.partition_keys`), a node is admitted for a partition only if the SuperLink registered it with that
key and it says it serves that partition. Any other node gets no model and its replies are never read; each
refusal, and each change of node for a partition, is a warning and a field of the round's metrics line
(`refused`, `moved`). It is a plain class, not a
`flwr.serverapp.strategy.Strategy`: Flower's strategies own sampling, aggregation and the round loop, all of
which fedlase keeps in its engine so that every engine computes the same thing."""
from __future__ import annotations

import logging
import math
import time

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from ..engine import RoundResult, RunnerPort, Update
from ..levels import Level
from ..privacy import client_bound, l2
from .codec import ReplyError, encode_submodel, record_bytes, validate_reply

log = logging.getLogger("fedlase")
REASON_CHARS = 400   # of a node's reason for refusing a task kept in the log and the metrics line (the node wrote it)


class NodeRounds:
    """Trains a round's clients on Flower nodes: prepare (messages) -> Flower delivers -> collect (updates)."""

    POLL = 0.2   # seconds between pulls for replies (a pull is one request to the SuperLink on its own host)

    def __init__(self, grid: Grid, reply_timeout: float = 600.0, pins: dict[int, str] | None = None):
        self.grid, self.reply_timeout = grid, reply_timeout
        self.pins = {int(k): v for k, v in (pins or {}).items()}   # partition id -> node key fingerprint
        self.nodes: dict[int, int] = {}        # partition id -> node id
        self.queried: set[int] = set()         # node ids asked (or refused) already
        self.keyed: dict[int, int] = {}        # node id -> the partition its key is pinned to
        self.events = {"refused": {}, "moved": {}}   # since the last metrics line (take_events)
        self.pending: dict[int, tuple] = {}    # partition id -> (message, level, submodel, bytes sent)
        self.bytes_total = {"sent": 0, "received": 0}
        self._dense: tuple[int, int] | None = None
        self.bound: float | None = None        # dp: the round's clip bound, which every reply must meet

    # ---- the runner interface ----------------------------------------------------------------------------------
    def train(self, exp: RunnerPort, rnd, picked, subs) -> RoundResult:
        msgs = self.prepare(exp, rnd, picked, subs)
        replies = self.exchange(msgs, self.reply_timeout) if msgs else []
        return self.collect(exp, rnd, replies)

    def exchange(self, msgs: list[Message], timeout: float) -> list[Message]:
        """Push the messages and collect their replies until all are in or `timeout` has passed. On a Flower
        Grid this is `Grid.send_and_receive` with a shorter wait between pulls (Flower's deployment Grid waits
        3 s, which a round then pays once more than it needs); any other grid (the tests') is asked as is."""
        if not isinstance(self.grid, Grid):
            return list(self.grid.send_and_receive(msgs, timeout=timeout))
        waiting = set(self.grid.push_messages(msgs))
        deadline, replies = time.monotonic() + timeout, []
        while waiting and time.monotonic() < deadline:
            got = list(self.grid.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if waiting:
                time.sleep(self.POLL)
        return replies

    def take_events(self) -> dict:
        """The nodes refused and the partitions moved since the last metrics line; from now, none."""
        events, self.events = self.events, {"refused": {}, "moved": {}}
        return events

    def async_schedule(self, cfg):
        """The engine's event loop for schedule=fedbuff on these nodes (fedlase/flower/buffered.py)."""
        from .buffered import NodeSchedule
        return NodeSchedule(cfg, self)

    def state_dict(self) -> dict:
        return {"bytes_total": dict(self.bytes_total)}

    def load_state_dict(self, state: dict) -> None:
        self.bytes_total = dict(state.get("bytes_total", self.bytes_total))

    # ---- who is where ----------------------------------------------------------------------------------------
    def discover(self, cfg, wait: bool) -> None:
        """QUERY the nodes not seen yet for their partition id and level. With `wait`, keep polling until
        every partition has a node or reply_timeout has passed (deployment nodes may connect late)."""
        n, deadline = cfg.num_clients, time.monotonic() + self.reply_timeout
        told = False
        while True:
            new = self._admissible([nid for nid in self.grid.get_node_ids() if nid not in self.queried])
            if new:
                msgs = [Message(RecordDict(), dst_node_id=nid, message_type=MessageType.QUERY) for nid in new]
                replies = self.exchange(msgs, max(1.0, deadline - time.monotonic()))
                asked = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}
                for reply in replies:
                    self._register(reply, asked.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id))
                self.queried.update(new)
            if not wait or len(self.nodes) == n or time.monotonic() >= deadline:
                break
            if not told:
                log.info("%d of %d partitions have a node; waiting up to %.0f s for the others",
                         len(self.nodes), n, deadline - time.monotonic())
                told = True
            time.sleep(1.0)
        if wait and len(self.nodes) < n:
            log.warning("only %d of %d partitions have a node; the others count as failed clients", len(self.nodes), n)

    def _admissible(self, new: list[int]) -> list[int]:
        """The new nodes worth asking who they are: with pins, only those registered with a pinned key (each
        remembered with its partition in `self.keyed`); the others are refused without being asked."""
        if not self.pins or not new:
            return new
        from .security import fingerprint
        by_key = {fp: pid for pid, fp in self.pins.items()}
        keys = {}
        for info in self.grid.get_nodes():
            if info.node_id in new:
                try:
                    keys[info.node_id] = fingerprint(info.public_key)
                except ValueError:
                    keys[info.node_id] = None
        ok = []
        for nid in new:
            if nid not in keys:   # online after the SuperLink listed the nodes' keys: looked at next time
                continue
            fp = keys[nid]
            if fp in by_key:
                self.keyed[nid] = by_key[fp]
                ok.append(nid)
            else:
                self.queried.add(nid)
                self._refuse(nid, None, f"its key ({fp or 'none'}) is pinned to no partition of this run")
        return ok

    def _refuse(self, nid: int, pid: int | None, why: str) -> None:
        log.warning("refused node %d%s: %s; it gets no model and its replies are ignored", nid,
                    "" if pid is None else f" for partition {pid}", why)
        self.events["refused"][str(nid)] = {"partition": pid, "reason": why}

    def _register(self, reply: Message, nid: int) -> None:
        if reply.has_error():
            log.warning("node %d did not say who it is: %s", nid, reply.error.reason)
            return
        cfg = self.cfg
        try:
            node = reply.content.config_records["node"]
            pid = int(node["partition-id"])
            level = str(node["level"]) if "level" in node else None   # None: the system spec's (simulation)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("node %d gave an unreadable identity (%s); ignored", nid, e)
            return
        if not 0 <= pid < cfg.num_clients:
            log.warning("node %d says partition %d, outside 0..%d; ignored", nid, pid, cfg.num_clients - 1)
            return
        expected = cfg.levels.level_of(pid)
        if cfg.assignment == "fixed" and level is not None and cfg.levels.find(level) != expected:
            log.warning("node %d (partition %d) declares level %s but system %s gives that partition %s; ignored",
                        nid, pid, level, cfg.system, expected.name)
            return
        if self.pins and self.keyed.get(nid) != pid:
            self._refuse(nid, pid, f"it claims partition {pid} but its key is pinned to partition "
                                   f"{self.keyed.get(nid)}")
            return
        if pid in self.nodes and self.nodes[pid] != nid:
            log.warning("partition %d moves from node %d to node %d", pid, self.nodes[pid], nid)
            self.events["moved"][str(pid)] = {"from": self.nodes[pid], "to": nid}
        self.nodes[pid] = nid

    # ---- one round -------------------------------------------------------------------------------------------
    def prepare(self, exp: RunnerPort, rnd: int, picked: list[tuple[int, Level]], subs: dict) -> list[Message]:
        """One TRAIN message per sampled client's node, with that level's submodel of the global model."""
        # this round's sampled clients and rejected replies, for collect(); the metrics line reports them
        self.pending = self.messages(exp, rnd, picked, subs)
        self.last = {"sampled": [c for c, _ in picked], "rejected": {}}
        return [m for m, *_ in self.pending.values()]

    def messages(self, exp: RunnerPort, rnd: int, picked: list[tuple[int, Level]], subs: dict) -> dict[int, tuple]:
        """partition id -> (its TRAIN message, level, submodel, bytes sent) for each picked client a node holds;
        `rnd`: the round whose batches it trains."""
        self.cfg = exp.cfg
        self.discover(exp.cfg, wait=not self.nodes)
        payload = {lvl: encode_submodel(exp.params, exp.buffers, s) for lvl, s in subs.items()}
        self.bound = client_bound(exp.server)   # dp: each node clips to it before it replies; checked in update_from()
        task = {} if self.bound is None else {"dp-clip": float(self.bound)}
        if exp.frozen is not None:   # a LoRA run: the node trains adapters on its own copy of the base, checked
            task |= {"frozen-count": int(exp.frozen["frozen"]), "frozen-sha256": str(exp.frozen["sha256"])}
        out = {}
        for pid, lvl in picked:
            if pid not in self.nodes:   # no node holds it: a failed client
                continue
            sub = exp.trainer.submodel(pid, subs[lvl], exp.params)   # its own under label_split
            data = payload[lvl] if sub is subs[lvl] else encode_submodel(exp.params, exp.buffers, sub)
            content = RecordDict({**data, "task": ConfigRecord(
                {"round": rnd, "partition-id": pid, "level": lvl.name, **task})})
            msg = Message(content, dst_node_id=self.nodes[pid], message_type=MessageType.TRAIN, group_id=str(rnd))
            out[pid] = (msg, lvl, sub, record_bytes(*data.array_records.values()))
        return out

    def collect(self, exp: RunnerPort, rnd: int, replies) -> RoundResult:
        """The good replies as updates, in partition-id order. A bad or missing reply leaves the model exactly
        as if that client had not been sampled; the metrics line says which clients failed or were rejected."""
        good, received = [], {}
        # Match replies by the message they answer: the SuperLink itself answers for a node that died, as
        # node 1. (The Grid set each message's id when it pushed it.)
        asked = {m.metadata.message_id: pid for pid, (m, *_) in self.pending.items()}
        for reply in replies:
            pid = asked.pop(reply.metadata.reply_to_message_id, None)
            if pid is None:
                log.warning("round %d: ignoring a reply that answers no message of this round", rnd)
                continue
            sent = self.pending[pid][0]
            if reply.has_error():
                log.warning("round %d: client %d failed: %s", rnd, pid, reply.error.reason)
                continue
            if reply.metadata.src_node_id == sent.metadata.dst_node_id:
                received[pid] = record_bytes(*reply.content.array_records.values())
            try:
                good.append(self.update_from(exp, rnd, pid, self.pending[pid], reply))
            except ReplyError as e:
                log.warning("round %d: rejected client %d's reply: %s", rnd, pid, e)
                self.last["rejected"][pid] = str(e)
        good.sort(key=lambda u: u.client)
        accepted = {u.client for u in good}
        failed = sorted(set(self.last["sampled"]) - accepted - set(self.last["rejected"]))
        b = self._bytes(exp, received)
        for key in self.bytes_total:
            self.bytes_total[key] += b[key]
        stats = {"sampled": len(self.last["sampled"]), "failed": failed,
                 "rejected": {str(k): v for k, v in self.last["rejected"].items()},
                 **self.take_events(), "bytes": b, "bytes_total": dict(self.bytes_total)}
        return RoundResult(good, stats)

    def update_from(self, exp: RunnerPort, rnd: int, pid: int, entry: tuple, reply: Message) -> Update:
        """Partition `pid`'s reply (not an error) to the message of `entry` (`messages`), as an update; a
        ReplyError says why it is refused."""
        sent, lvl, sub, _ = entry
        if reply.metadata.src_node_id != sent.metadata.dst_node_id:
            raise ReplyError(f"reply from node {reply.metadata.src_node_id}, not from node "
                             f"{sent.metadata.dst_node_id}")
        refused = reply.content.config_records.get("refused")
        if refused is not None:   # the node would not train (client_app.base_refusal): its reason, on one short line
            why = " ".join(str(refused.get("reason", "(no reason given)")).split())
            raise ReplyError(f"the node refused to train: {why[:REASON_CHARS]}")
        try:
            m = reply.content.metric_records["metrics"]
            if int(m["partition-id"]) != pid or int(m["round"]) != rnd:
                raise ReplyError(f"reply for partition {m['partition-id']} round {m['round']}")
            delta = validate_reply(reply.content.array_records["delta"], exp.params, sub, exp.server.own_reply(lvl))
            loss = float(m["train-loss"])
        except ReplyError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ReplyError(str(e)) from None
        # dp: a node that did not clip is caught here (the server clips again, so it would add nothing beyond
        # the bound; refusing it records the fault)
        if self.bound is not None and (norm := l2(delta)) > self.bound * (1 + 1e-5):
            raise ReplyError(f"unclipped update: L2 norm {norm:.4g} exceeds the round's dp clip bound "
                             f"{self.bound:.4g}")
        if not math.isfinite(loss):   # the engine's screen would too; refused here with the wire's checks
            raise ReplyError(f"non-finite train-loss ({loss})")
        return Update(pid, lvl, delta, loss, sub)

    def _bytes(self, exp: RunnerPort, received: dict[int, int]) -> dict:
        """Bytes sent and received this round, in all and per level, against a dense exchange of the whole
        model (down: parameters and buffers; up: parameters)."""
        from flwr.app import ArrayRecord
        out = {"sent": 0, "received": 0, "dense_sent": 0, "dense_received": 0, "levels": {}}
        if self._dense is None:   # shapes never change: measure the dense encoding once
            up = record_bytes(ArrayRecord({k: v.detach().cpu() for k, v in exp.params.items()}))
            self._dense = (up + record_bytes(ArrayRecord({k: v.detach().cpu() for k, v in exp.buffers.items()})), up)
        dense_down, dense_up = self._dense
        for pid, (_, lvl, _, sent) in self.pending.items():
            got = received.get(pid, 0)
            row = out["levels"].setdefault(lvl.name, {"clients": 0, "sent": 0, "received": 0})
            row["clients"] += 1
            row["sent"] += sent
            row["received"] += got
            out["sent"] += sent
            out["received"] += got
            out["dense_sent"] += dense_down
            out["dense_received"] += dense_up if got else 0
        return out
