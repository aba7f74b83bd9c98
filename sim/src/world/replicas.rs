//! The allocator replicas and etcd, when the scenario models failover
//! ([`crate::failover`]): delivery to the leader (or a refusal), the
//! write-ahead records and their durability, keep-alives and elections.

use quotalease_allocator::leadership::Arrival;

use super::*;

impl World {
    /// Failover: a batch for the leader of epoch `term` (0: none known).
    pub(super) fn deliver_to_replicas(&mut self, from: Node, batch: LeaseBatch, term: u64) {
        let t = self.t;
        let now = self.global.clock.local(t);
        let Some(fo) = self.failover.as_mut() else {
            return;
        };
        // Queued at a deposed leader: its own gate decides when it wakes.
        if let Some(d) = fo
            .deposed
            .as_mut()
            .filter(|d| term != 0 && d.term.epoch == term)
        {
            let reply = if d.term.gate.serving(now) {
                // Fencing failed: the run reports it (and I1 may break).
                fo.deposed_grants += 1;
                d.core.handle(now, &batch)
            } else {
                fo.deposed_refusals += 1;
                d.term.gate.refusal(&batch, now)
            };
            self.transmit(Node::Global, from, Msg::Reply(reply));
            return;
        }
        let leading = fo
            .term
            .as_ref()
            .is_some_and(|c| (term == 0 || term == c.epoch) && self.global.core.is_some());
        if !leading {
            // No leader yet, or the one named is dead: a follower answers.
            fo.no_leader_replies += 1;
            let reply = fo.follower.refusal(&batch, now);
            self.transmit(Node::Global, from, Msg::Reply(reply));
            return;
        }
        let term = fo.term.as_mut().expect("leading");
        let core = self.global.core.as_mut().expect("leading");
        // The serving gate, as the tokio driver's (`LeaseService::lease`).
        let epoch = match term.gate.arrive(&batch, now) {
            Arrival::Serve(epoch) => epoch,
            Arrival::Refuse { reply, observe } => {
                if observe {
                    core.observe(now, &batch);
                }
                self.transmit(Node::Global, from, Msg::Reply(*reply));
                return;
            }
        };
        let reply = core.handle(now, &batch);
        check_i2_core(core, now, &batch, &mut self.i2_violations, t);
        let needs = core.reservation_seq();
        if needs <= term.durable_seq {
            let reply = term.gate.depart(epoch, &batch, reply, now);
            self.transmit(Node::Global, from, Msg::Reply(reply));
        } else {
            term.held.push((needs, from, batch, reply));
        }
        self.write_records();
    }

    /// Failover: what the leader's core appended goes to etcd, durable
    /// `write_lag` later.
    pub(super) fn write_records(&mut self) {
        let Some(fo) = self.failover.as_ref() else {
            return;
        };
        let Some(epoch) = fo.term.as_ref().map(|t| t.epoch) else {
            return;
        };
        let lag = fo.cfg.write_lag_ns;
        let Some((seq, records)) = self
            .global
            .core
            .as_mut()
            .and_then(|c| c.reservations_mut())
            .map(|r| r.take())
        else {
            return;
        };
        if !records.is_empty() {
            self.schedule(
                self.t + lag,
                Event::Durable {
                    epoch,
                    seq,
                    records,
                },
            );
        }
    }

    /// Failover: records of `epoch` are durable, if it still leads; the
    /// replies that waited for them go out if its gate still lets it.
    pub(super) fn durable(
        &mut self,
        epoch: u64,
        seq: u64,
        records: Vec<quotalease_allocator::reservations::Record>,
    ) {
        let t = self.t;
        let now = self.global.clock.local(t);
        let alive = self.global.core.is_some();
        let Some(fo) = self.failover.as_mut() else {
            return;
        };
        if !alive || !fo.commit(epoch, seq, records) {
            return; // a dead or deposed leader's write: its guard fails
        }
        let term = fo.term.as_mut().expect("committed");
        let durable = term.durable_seq;
        let (ready, waiting): (Vec<_>, Vec<_>) = term.held.drain(..).partition(|h| h.0 <= durable);
        term.held = waiting;
        // Sent stamped, or refused if the term lapsed meanwhile (as the
        // tokio driver: before, the simulator dropped such a reply).
        let replies: Vec<_> = ready
            .into_iter()
            .map(|(_, to, batch, reply)| (to, term.gate.depart(epoch, &batch, reply, now)))
            .collect();
        for (to, reply) in replies {
            self.transmit(Node::Global, to, Msg::Reply(reply));
        }
    }

    /// Failover: the leader of `epoch` renews its lease (alive and awake).
    pub(super) fn keep_alive(&mut self, epoch: u64) {
        let t = self.t;
        if self.global.core.is_none() || t < self.global.asleep_until {
            return; // dead, or frozen: nothing is sent (re-armed on wake)
        }
        let now = self.global.clock.local(t);
        let Some(fo) = self.failover.as_mut() else {
            return;
        };
        if fo.term.as_ref().map(|t| t.epoch) != Some(epoch) {
            return;
        }
        fo.keep_alive(t, now);
        let (every, next) = (fo.cfg.keep_alive_ns, fo.successor_at());
        self.schedule(t + every, Event::KeepAlive(epoch));
        self.schedule(next, Event::Election);
    }

    /// Failover: a successor takes over once the leader's lease expired and
    /// the election is over; a leader still running is deposed.
    pub(super) fn election(&mut self) {
        let t = self.t;
        let Some(fo) = self.failover.as_mut() else {
            return;
        };
        if fo.term.is_none() || t < fo.successor_at() {
            return;
        }
        let term = fo.term.take().expect("checked");
        fo.deposed = self.global.core.take().map(|core| Deposed {
            core,
            term,
            asleep_until: self.global.asleep_until,
        });
        // The successor runs on another machine: awake.
        self.global.asleep_until = 0;
        self.boot_global(false);
    }
}
