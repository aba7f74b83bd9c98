//! Who may grant (SPEC §7): with `--etcd` only the elected leader does, and
//! only while its leadership is surely valid. The election itself (etcd)
//! is the binary's driver; this is the gate the lease service asks before
//! every batch, and what every reply says about the replicas.
//!
//! Validity is measured on `CLOCK_BOOTTIME` (which counts while the machine
//! is suspended; the simulator passes its own clock readings) from when a
//! keep-alive of
//! the leader's etcd lease was *sent*, not answered: etcd renews the lease
//! for its whole TTL when it receives the keep-alive, so the lease cannot
//! expire (and no other replica can be elected) before `sent + TTL` on
//! etcd's clock. The driver sets `valid_until` a safety margin before that
//! (clock rate differences, scheduling), so a deposed leader — partitioned,
//! or frozen and woken up — stops granting before a successor can exist.

use parking_lot::Mutex;
use quotalease_proto::lease::{LeaseBatch, LeaseReply, ShardRoute};
use quotalease_proto::PROTOCOL_VERSION;

/// What the serving gate says of an arriving batch ([`Leadership::arrive`]).
#[derive(Debug)]
pub enum Arrival {
    /// Serve it; its reply goes out through [`Leadership::depart`] with this
    /// term.
    Serve(u64),
    /// Answer this, nothing applied; with `observe`, let the core look at
    /// what the batch presents first.
    Refuse {
        /// The refusal to send.
        reply: Box<LeaseReply>,
        /// This replica leads but waits out its predecessor.
        observe: bool,
    },
}

/// The key window of a leader whose etcd session lease lasts
/// `lease_ttl_ns`: `max(TTL/3, 1 s)` in whole seconds. A confirmation of
/// its leader key keeps a leader valid this long (its validity margin
/// under the lease), so a successor that did not get a clean handover
/// waits it out ([`successor_serves_from`]). The etcd driver and the
/// simulator's failover model both use it.
pub fn key_window_ns(lease_ttl_ns: u64) -> u64 {
    const SEC: u64 = 1_000_000_000;
    (lease_ttl_ns / 3 / SEC).max(1) * SEC
}

/// How often a leader keeps its etcd session lease alive and confirms its
/// leader key: every sixth of the lease's TTL, at least every 200 ms. The
/// etcd driver and the simulator's failover model both use it.
pub fn keep_alive_every_ns(lease_ttl_ns: u64) -> u64 {
    (lease_ttl_ns / 6).max(200_000_000)
}

/// How long an answered keep-alive keeps a leader valid on its own clock,
/// from the keep-alive's send: the lease's TTL as etcd answered it, less
/// the margin ([`key_window_ns`] of the session's TTL) for the clocks' rate
/// error and etcd's own lateness.
pub fn lease_validity_ns(answered_ttl_ns: u64, lease_ttl_ns: u64) -> u64 {
    answered_ttl_ns.saturating_sub(key_window_ns(lease_ttl_ns))
}

/// When a successor elected at `now`, resuming from the reservations
/// (its predecessor did not hand over), may grant: after its
/// predecessor's longest validity, a key window, with the clocks' rate
/// error (1/500) and 10 ms.
pub fn successor_serves_from(now: u64, key_window_ns: u64) -> u64 {
    now + key_window_ns + key_window_ns / 500 + 10_000_000
}

/// What replicas know of each other; stamped on every reply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// The leader's advertised URL; empty while there is none.
    pub leader_url: String,
    /// Every live replica's advertised URL.
    pub replicas: Vec<String>,
    /// The leader's epoch (its election revision); 0 while there is none.
    pub epoch: u64,
    /// Version of the shard map (0: one shard).
    pub shard_map_version: u64,
    /// The shard this replica serves, of `shard_count` (0 and 0: not
    /// sharded).
    pub shard: u32,
    /// See `shard`.
    pub shard_count: u32,
    /// Every shard's leader and replicas as last read from etcd (this
    /// replica's own shard included).
    pub shard_routes: Vec<ShardRoute>,
}

#[derive(Debug, Default)]
struct State {
    /// Replicas and shard map; the leader fields are filled by `view`.
    view: View,
    /// The election's leader as last observed, whatever this replica's
    /// own state (an observation made while leading, or frozen, is kept).
    observed: (String, u64),
    /// `Some` while this replica leads: grants are allowed until then
    /// (clock reading, ns).
    valid_until: Option<u64>,
    /// Epoch of the term `valid_until` belongs to.
    term: u64,
    /// A new term grants nothing before this clock reading (a predecessor
    /// may still be within its own validity; see [`Leadership::lead`]).
    serve_from: u64,
}

/// The gate (see the module docs).
#[derive(Debug)]
pub struct Leadership {
    advertise: String,
    /// How long a replica without a leader tells requesters to wait.
    retry_after_ms: u64,
    state: Mutex<State>,
}

impl Leadership {
    /// A replica advertised as `advertise`, not leading yet.
    pub fn new(advertise: String, retry_after_ms: u64) -> Self {
        Self {
            advertise,
            retry_after_ms,
            state: Mutex::default(),
        }
    }

    /// This replica's advertised URL.
    pub fn advertise(&self) -> &str {
        &self.advertise
    }

    /// True at clock reading `now` (ns) while this replica leads, its
    /// leadership surely valid, and its wait for its predecessor is over.
    pub fn serving(&self, now: u64) -> bool {
        let s = self.state.lock();
        s.valid_until.is_some_and(|v| now < v) && now >= s.serve_from
    }

    /// True at `now` while this replica's term is valid (it may be waiting
    /// to grant).
    pub fn leading(&self, now: u64) -> bool {
        self.state.lock().valid_until.is_some_and(|v| now < v)
    }

    /// While this replica leads but may not grant yet: until when.
    pub fn waiting_until(&self, now: u64) -> Option<u64> {
        let s = self.state.lock();
        (s.valid_until.is_some_and(|v| now < v) && now < s.serve_from).then_some(s.serve_from)
    }

    /// The epoch of the current term, if this replica leads.
    pub fn term(&self) -> Option<u64> {
        let s = self.state.lock();
        s.valid_until.map(|_| s.term)
    }

    /// This replica won the election of `epoch`; it may grant from
    /// `serve_from` until `valid_until` (see [`Leadership::extend`]). A
    /// successor whose predecessor did not hand over cleanly waits out the
    /// predecessor's longest possible validity first: a leader key can be
    /// deleted while its lease lives (a campaign's clean-up on a waking etcd
    /// member), so that only the key confirmations bound it.
    pub fn lead(&self, epoch: u64, valid_until: u64, serve_from: u64) {
        let mut s = self.state.lock();
        s.term = epoch;
        s.valid_until = Some(valid_until);
        s.serve_from = serve_from;
    }

    /// A keep-alive of term `epoch` succeeded: valid until `valid_until`
    /// (never shortened). Ignored for another term.
    pub fn extend(&self, epoch: u64, valid_until: u64) {
        let mut s = self.state.lock();
        if s.term == epoch {
            if let Some(v) = &mut s.valid_until {
                *v = (*v).max(valid_until);
            }
        }
    }

    /// This replica no longer leads (deposed, or its validity ran out).
    pub fn step_down(&self) {
        self.state.lock().valid_until = None;
    }

    /// The election's current leader as observed (`""`: none), with its
    /// epoch. Kept whatever this replica's own state: a replica that stops
    /// leading (or wakes from a freeze) names the leader it saw elected.
    pub fn observed_leader(&self, url: &str, epoch: u64) {
        self.state.lock().observed = (url.to_string(), epoch);
    }

    /// The live replicas as listed in etcd.
    pub fn set_replicas(&self, mut replicas: Vec<String>) {
        replicas.sort();
        replicas.dedup();
        self.state.lock().view.replicas = replicas;
    }

    /// This replica serves shard `shard` of `count`, under shard map
    /// version `version`.
    pub fn set_shard(&self, shard: u32, count: u32, version: u64) {
        let mut s = self.state.lock();
        s.view.shard = shard;
        s.view.shard_count = count;
        s.view.shard_map_version = version;
    }

    /// Every shard's leader and replicas as read from etcd.
    pub fn set_shard_routes(&self, routes: Vec<ShardRoute>) {
        self.state.lock().view.shard_routes = routes;
    }

    /// What replies say of the replicas at `now`: this replica as the
    /// leader while it may grant, else the leader last observed (never
    /// itself).
    pub fn view(&self, now: u64) -> View {
        let s = self.state.lock();
        let mut v = s.view.clone();
        if s.valid_until.is_some_and(|until| now < until) {
            v.leader_url = self.advertise.clone();
            v.epoch = s.term;
        } else if s.observed.0 != self.advertise {
            v.leader_url = s.observed.0.clone();
            v.epoch = s.observed.1;
        }
        v
    }

    /// Stamp `reply` to `batch` with the view. The shard routes go only
    /// where the requester may need them (they grow with the shard
    /// count): to a heartbeat, to a batch meant for another shard, and to
    /// one that had an item of another shard's key.
    pub fn stamp(&self, batch: &LeaseBatch, reply: &mut LeaseReply, now: u64) {
        let v = self.view(now);
        reply.leader_url = v.leader_url;
        reply.replicas = v.replicas;
        reply.shard_map_version = v.shard_map_version;
        if v.shard_count > 1 {
            reply.shard = v.shard;
            reply.shard_count = v.shard_count;
            let wrong = quotalease_proto::lease::GrantStatus::WrongShard as i32;
            if batch.items.is_empty()
                || batch.shard != v.shard
                || reply.grants.iter().any(|g| g.status == wrong)
            {
                reply.shard_routes = v.shard_routes;
            }
        }
    }

    /// The serving gate (SPEC §7), for a batch that arrives at `now`:
    /// serve it in the current term, or answer it with a refusal (nothing
    /// applied). `observe` says the refusal comes from a leader still
    /// waiting out its predecessor: what the batch presents of the state
    /// that served it counts all the same (`AllocatorCore::observe`). The
    /// tokio driver and the simulator both ask here.
    pub fn arrive(&self, batch: &LeaseBatch, now: u64) -> Arrival {
        match self.term().filter(|_| self.serving(now)) {
            Some(term) => Arrival::Serve(term),
            None => Arrival::Refuse {
                observe: self.leading(now),
                reply: Box::new(self.refusal(batch, now)),
            },
        }
    }

    /// The gate's second half: `reply` to `batch`, decided in `term` and
    /// durable now (`now`), goes out stamped with the view, or, if that
    /// term is no longer the current one or no longer valid (a successor
    /// may already resume without knowing it was sent), a refusal.
    pub fn depart(
        &self,
        term: u64,
        batch: &LeaseBatch,
        mut reply: LeaseReply,
        now: u64,
    ) -> LeaseReply {
        if self.term() != Some(term) || !self.serving(now) {
            return self.refusal(batch, now);
        }
        self.stamp(batch, &mut reply, now);
        reply
    }

    /// The reply at `now` of a replica that may not grant: nothing
    /// applied, go to the leader, or (none yet) ask again after a while.
    pub fn refusal(&self, batch: &LeaseBatch, now: u64) -> LeaseReply {
        let v = self.view(now);
        // Our own URL as "leader" only while we may grant (a refusal then
        // comes from a term that ended between a batch's arrival and its
        // reply): no leader for the requester.
        let leader_url = if v.leader_url == self.advertise {
            String::new()
        } else {
            v.leader_url
        };
        LeaseReply {
            seq: batch.header.as_ref().map_or(0, |h| h.seq),
            epoch: v.epoch,
            protocol_version: PROTOCOL_VERSION,
            request_digest: quotalease_proto::request_digest(batch),
            retry_after_ms: if leader_url.is_empty() {
                self.retry_after_ms
            } else {
                0
            },
            leader_url,
            replicas: v.replicas,
            shard_map_version: v.shard_map_version,
            shard: v.shard,
            shard_count: v.shard_count,
            shard_routes: v.shard_routes,
            not_leader: true,
            ..LeaseReply::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn grants_only_within_validity_of_the_current_term() {
        let l = Leadership::new("http://a:1".into(), 500);
        let t0 = 100 * S;
        assert!(!l.serving(t0));
        l.lead(7, t0 + 2 * S, 0);
        assert!(l.serving(t0 + 2 * S - 1));
        assert!(!l.serving(t0 + 2 * S));
        // Another term's keep-alive does not extend this one.
        l.extend(6, t0 + 9 * S);
        assert!(!l.serving(t0 + 3 * S));
        l.extend(7, t0 + 4 * S);
        assert!(l.serving(t0 + 3 * S));
        // Never shortened by a late keep-alive answer.
        l.extend(7, t0 + S);
        assert!(l.serving(t0 + 3 * S));
        l.step_down();
        assert!(!l.serving(t0));
        assert_eq!(l.term(), None);
    }

    #[test]
    fn the_gate_serves_in_a_valid_term_and_refuses_a_reply_whose_term_lapsed() {
        let l = Leadership::new("http://a:1".into(), 500);
        let batch = LeaseBatch::default();
        let t0 = 100 * S;
        // A follower refuses; nothing to observe.
        assert!(matches!(
            l.arrive(&batch, t0),
            Arrival::Refuse { observe: false, .. }
        ));
        // A leader waiting out its predecessor refuses but observes.
        l.lead(7, t0 + 5 * S, t0 + S);
        match l.arrive(&batch, t0) {
            Arrival::Refuse { reply, observe } => assert!(observe && reply.not_leader),
            a => panic!("{a:?}"),
        }
        // Serving: the reply goes out stamped with this replica as leader.
        assert!(matches!(l.arrive(&batch, t0 + S), Arrival::Serve(7)));
        let out = l.depart(7, &batch, LeaseReply::default(), t0 + 2 * S);
        assert!(!out.not_leader);
        assert_eq!(out.leader_url, "http://a:1");
        // Its validity ran out while the reply waited for durability, or
        // another term began: refused, never sent as decided.
        assert!(
            l.depart(7, &batch, LeaseReply::default(), t0 + 5 * S)
                .not_leader
        );
        l.lead(8, t0 + 9 * S, 0);
        assert!(
            l.depart(7, &batch, LeaseReply::default(), t0 + 2 * S)
                .not_leader
        );
    }

    #[test]
    fn the_key_window_is_a_third_of_the_lease_in_whole_seconds_at_least_one() {
        for (ttl_ms, window_s) in [
            (2_000, 1),
            (2_500, 1),
            (3_000, 1),
            (9_000, 3),
            (10_000, 3),
            (60_000, 20),
        ] {
            assert_eq!(
                key_window_ns(ttl_ms * 1_000_000),
                window_s * S,
                "TTL {ttl_ms} ms"
            );
        }
        // The successor waits the window, its rate error and 10 ms.
        assert_eq!(
            successor_serves_from(5 * S, S),
            6 * S + 2_000_000 + 10_000_000
        );
    }

    #[test]
    fn a_refusal_redirects_to_the_leader_or_says_there_is_none() {
        let l = Leadership::new("http://a:1".into(), 500);
        l.set_replicas(vec!["http://b:1".into(), "http://a:1".into()]);
        let batch = LeaseBatch::default();
        let r = l.refusal(&batch, S);
        assert!(r.not_leader && r.grants.is_empty());
        assert_eq!((r.leader_url.as_str(), r.retry_after_ms), ("", 500));
        assert_eq!(r.replicas, vec!["http://a:1", "http://b:1"]);
        l.observed_leader("http://b:1", 42);
        let r = l.refusal(&batch, S);
        assert_eq!(
            (r.leader_url.as_str(), r.epoch, r.retry_after_ms),
            ("http://b:1", 42, 0)
        );
        // A leader whose validity ran out names the leader it saw elected
        // (here the older observation), never itself.
        let now = 100 * S;
        l.lead(43, now, 0);
        let r = l.refusal(&batch, now);
        assert_eq!(r.leader_url, "http://b:1");
        l.observed_leader("http://a:1", 43);
        let r = l.refusal(&batch, now);
        assert_eq!(r.leader_url, "");
        assert!(r.retry_after_ms > 0);
    }

    #[test]
    fn a_successor_waits_before_it_grants() {
        let l = Leadership::new("http://a:1".into(), 500);
        let t0 = 100 * S;
        l.lead(3, t0 + 5 * S, t0 + 2 * S);
        assert!(!l.serving(t0 + S));
        assert_eq!(l.waiting_until(t0 + S), Some(t0 + 2 * S));
        assert!(l.serving(t0 + 2 * S));
        assert_eq!(l.waiting_until(t0 + 2 * S), None);
        // Waiting, it refuses as a replica without a leader does.
        let r = l.refusal(&LeaseBatch::default(), t0 + S);
        assert!(r.not_leader && r.leader_url.is_empty() && r.retry_after_ms > 0);
    }

    #[test]
    fn an_observation_made_while_leading_or_frozen_is_kept() {
        let l = Leadership::new("http://a:1".into(), 500);
        let t0 = 100 * S;
        l.lead(7, t0 + 2 * S, 0);
        assert_eq!(l.view(t0).leader_url, "http://a:1");
        // The successor is observed while this replica still thinks it
        // leads (frozen, its validity gone): after step-down, or once the
        // validity has run out, the view names the successor.
        l.observed_leader("http://b:1", 9);
        assert_eq!(l.view(t0).leader_url, "http://a:1");
        assert_eq!(l.view(t0 + 3 * S).leader_url, "http://b:1");
        l.step_down();
        assert_eq!(
            (l.view(t0).leader_url.as_str(), l.view(t0).epoch),
            ("http://b:1", 9)
        );
    }
}
