"""The server side of a round on Flower's Message API, as a `flwr.serverapp.strategy.Strategy`.

It holds no algorithm of its own: the embedded engine's `Experiment` (seeded `sample`, the method's
`submodels`, the global model) decides who trains what, and the engine's `Aggregator` combines the replies,
in partition-id order, exactly as the embedded engine does. What it adds is the wire: finding which node
holds which partition (QUERY), one TRAIN message per node carrying that node's own submodel, checking every
reply (`codec.validate_reply`) and counting bytes."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..aggregate import Aggregator
from ..engine import Experiment, level_name
from .codec import ReplyError, encode_submodel, record_bytes, validate_reply

log = logging.getLogger("fedlase")


class SubmodelStrategy(Strategy):
    """One round: configure_train -> (Flower delivers) -> aggregate_train. Evaluation is central, on the
    server, as in the embedded engine, so the client-side evaluate steps are empty."""

    def __init__(self, exp: Experiment, min_replies: int = 1, reply_timeout: float = 600.0):
        self.exp, self.min_replies, self.reply_timeout = exp, min_replies, reply_timeout
        self.nodes: dict[int, int] = {}        # partition id -> node id
        self.levels: dict[int, float] = {}     # partition id -> the level its node declared
        self.queried: set[int] = set()         # node ids asked already
        self.pending: dict[int, tuple] = {}    # partition id -> (message, level, submodel, bytes sent)
        self.last: dict = {}                   # the last round's statistics, for the metrics line
        self._dense: tuple[int, int] | None = None

    # ---- who is where ----------------------------------------------------------------------------------------
    def discover(self, grid: Grid, wait: bool) -> None:
        """QUERY the nodes not seen yet for their partition id and level. With `wait`, keep polling until
        every partition has a node or reply_timeout has passed (deployment nodes may connect late)."""
        n, deadline = self.exp.cfg.num_clients, time.monotonic() + self.reply_timeout
        told = False
        while True:
            new = [nid for nid in grid.get_node_ids() if nid not in self.queried]
            if new:
                msgs = [Message(RecordDict(), dst_node_id=nid, message_type=MessageType.QUERY) for nid in new]
                replies = grid.send_and_receive(msgs, timeout=max(1.0, deadline - time.monotonic()))
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

    def _register(self, reply: Message, nid: int) -> None:
        if reply.has_error():
            log.warning("node %d did not say who it is: %s", nid, reply.error.reason)
            return
        cfg = self.exp.cfg
        try:
            node = reply.content.config_records["node"]
            pid, level = int(node["partition-id"]), float(node["level"])
        except (KeyError, TypeError, ValueError) as e:
            log.warning("node %d gave an unreadable identity (%s); ignored", nid, e)
            return
        if not 0 <= pid < cfg.num_clients:
            log.warning("node %d says partition %d, outside 0..%d; ignored", nid, pid, cfg.num_clients - 1)
            return
        if cfg.assignment == "fixed" and level != cfg.client_levels[pid]:
            log.warning("node %d (partition %d) declares level %s but system %s gives that partition %s; ignored",
                        nid, pid, level_name(level), cfg.system, level_name(cfg.client_levels[pid]))
            return
        if pid in self.nodes and self.nodes[pid] != nid:
            log.warning("partition %d moves from node %d to node %d", pid, self.nodes[pid], nid)
        self.nodes[pid], self.levels[pid] = nid, level

    # ---- the four steps --------------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per sampled client's node, with that level's submodel of the global model. The global
        model is the Experiment's (`arrays` is not read: it would be a copy of the same)."""
        exp = self.exp
        self.discover(grid, wait=not self.nodes)
        picked = exp.sample(server_round)
        subs = exp.submodels([lvl for _, lvl in picked], server_round)
        payload = {lvl: encode_submodel(exp.params, exp.buffers, s) for lvl, s in subs.items()}
        self.pending, self.last = {}, {"sampled": [c for c, _ in picked], "rejected": {}}
        msgs = []
        for pid, lvl in picked:
            if pid not in self.nodes:   # no node holds it: a failed client
                continue
            content = RecordDict({**payload[lvl], "task": ConfigRecord(
                {"round": server_round, "partition-id": pid, "level": lvl, **dict(config)})})
            msg = Message(content, dst_node_id=self.nodes[pid], message_type=MessageType.TRAIN,
                          group_id=str(server_round))
            self.pending[pid] = (msg, lvl, subs[lvl], record_bytes(*payload[lvl].array_records.values()))
            msgs.append(msg)
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Check each reply, then add the good ones in partition-id order. A bad or missing reply leaves the
        model exactly as if that client had not been sampled; fewer than min_replies good ones leave the
        model unchanged."""
        exp, good, received = self.exp, [], {}
        # Match replies by the message they answer: the SuperLink itself answers for a node that died, as
        # node 1. (The Grid set each message's id when it pushed it.)
        asked = {m.metadata.message_id: pid for pid, (m, *_) in self.pending.items()}
        for reply in replies:
            pid = asked.pop(reply.metadata.reply_to_message_id, None)
            if pid is None:
                log.warning("round %d: ignoring a reply that answers no message of this round", server_round)
                continue
            _, lvl, sub, _ = self.pending[pid]
            if reply.has_error():
                log.warning("round %d: client %d failed: %s", server_round, pid, reply.error.reason)
                continue
            received[pid] = record_bytes(*reply.content.array_records.values())
            try:
                m = reply.content.metric_records["metrics"]
                if int(m["partition-id"]) != pid or int(m["round"]) != server_round:
                    raise ReplyError(f"reply for partition {m['partition-id']} round {m['round']}")
                delta = validate_reply(reply.content.array_records["delta"], exp.params, sub)
                loss = float(m["train-loss"])
            except (KeyError, TypeError, ValueError) as e:   # ReplyError is a ValueError
                log.warning("round %d: rejected client %d's reply: %s", server_round, pid, e)
                self.last["rejected"][pid] = str(e)
                continue
            good.append((pid, lvl, delta, sub, loss))
        good.sort(key=lambda g: g[0])
        self.last["failed"] = sorted(set(self.last["sampled"]) - {g[0] for g in good} - set(self.last["rejected"]))
        self.last["bytes"] = self._bytes(received)
        self.last["clients"] = len(good)
        self.last["train_loss"] = float(np.mean([g[4] for g in good])) if good else float("nan")
        self.last["accepted"] = [(g[0], g[1]) for g in good]
        self.last["submodels"] = {g[1]: g[3] for g in good}
        if len(good) < max(1, self.min_replies):
            log.warning("round %d: %d good replies, fewer than min_replies=%d; global model unchanged",
                        server_round, len(good), self.min_replies)
            self.last["skipped"] = True
            return None, MetricRecord({"clients": len(good)})
        agg = Aggregator(exp.params, exp.method.aggregation)
        for _, _, delta, sub, _ in good:
            agg.add(delta, sub)
        exp.params = agg.result()
        return ArrayRecord({k: v.detach().cpu() for k, v in exp.params.items()}), \
            MetricRecord({"clients": len(good), "train-loss": self.last["train_loss"]})

    def _bytes(self, received: dict[int, int]) -> dict:
        """Bytes sent and received this round, in all and per level, against a dense exchange of the whole
        model (down: parameters and buffers; up: parameters)."""
        out = {"sent": 0, "received": 0, "dense_sent": 0, "dense_received": 0, "levels": {}}
        if self._dense is None:   # shapes never change: measure the dense encoding once
            up = record_bytes(ArrayRecord({k: v.detach().cpu() for k, v in self.exp.params.items()}))
            self._dense = (up + record_bytes(ArrayRecord({k: v.detach().cpu() for k, v in self.exp.buffers.items()})), up)
        dense_down, dense_up = self._dense
        for pid, (_, lvl, _, sent) in self.pending.items():
            got = received.get(pid, 0)
            row = out["levels"].setdefault(level_name(lvl), {"clients": 0, "sent": 0, "received": 0})
            row["clients"] += 1
            row["sent"] += sent
            row["received"] += got
            out["sent"] += sent
            out["received"] += got
            out["dense_sent"] += dense_down
            out["dense_received"] += dense_up if got else 0
        return out

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info("SubmodelStrategy: method %s, min_replies %d, reply_timeout %.0f s",
                 self.exp.cfg.method, self.min_replies, self.reply_timeout)
