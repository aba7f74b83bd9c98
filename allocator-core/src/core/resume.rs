//! A clean stop's checkpoint, and a start resumed from one or from the
//! write-ahead reservations; the promises a start makes durable first.

use super::*;

impl AllocatorCore {
    /// A clean shutdown at `now_ns`: every key's checkpoint, and from now
    /// on nothing is granted (every batch is answered "unavailable"), so
    /// the checkpoint stays the whole truth.
    pub fn checkpoint_and_close(&mut self, now_ns: u64) -> Vec<(KeyId, KeyCheckpoint)> {
        self.closed = true;
        let mut out: Vec<(KeyId, KeyCheckpoint)> = self
            .keys
            .iter_mut()
            .map(|(k, l)| (k.clone(), l.checkpoint(now_ns)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Resume keys from a clean shutdown's checkpoint at `now_ns`
    /// ([`KeyLedger::resume`]); keys of rules that no longer exist are
    /// dropped. Keys not in it start full: the shutdown recorded every key
    /// it had, and a key it did not have was full.
    pub fn resume_keys(&mut self, now_ns: u64, keys: Vec<(KeyId, KeyCheckpoint)>) {
        for (key, cp) in keys {
            let Some(rule) = self.rules.get(key.rule()) else {
                continue;
            };
            let margin = drift_margin_ns(cp.leases_end_in_ns) + 1 + self.cfg.epsilon_ns;
            let mut ledger = KeyLedger::resume(rule.rate, rule.burst, now_ns, &cp, margin);
            *self
                .keys_per_rule
                .entry(key.rule().to_string())
                .or_insert(0) += 1;
            ledger.sweep_due_ns = now_ns
                .saturating_add(cp.leases_end_in_ns)
                .saturating_add(margin)
                .max(1);
            self.sweep_due
                .push(std::cmp::Reverse((ledger.sweep_due_ns, key.clone())));
            self.keys.insert(key, Box::new(ledger));
        }
    }

    /// Resume after a crash from the durable reservations (SPEC §2
    /// "Restarts", [`crate::reservations`]) at `now_ns`: each recorded key
    /// at its floor, the rest of its burst one phantom lease lending its
    /// rate cap until the longest lease the predecessor could have granted
    /// has expired (`restart_wait_ns`); keys without a record start full.
    /// Call [`AllocatorCore::reserve_current_keys`] before serving.
    pub fn resume_reserved(&mut self, now_ns: u64, records: Vec<(KeyId, Reservation)>) {
        let ttl = self.cfg.ttl_max_ns.max(self.cfg.predecessor_ttl_max_ns);
        let keys = records
            .iter()
            .filter_map(|(key, r)| {
                let rule = self.rules.get(key.rule())?;
                let floor = r.floor.min(rule.burst);
                Some((
                    key.clone(),
                    KeyCheckpoint {
                        available: floor,
                        outstanding: rule.burst - floor,
                        rates_out_utps: r.rate_cap_utps,
                        leases_end_in_ns: ttl,
                    },
                ))
            })
            .collect();
        self.resume_keys(now_ns, keys);
    }

    /// Make every key's state at `now_ns` its promise (after a resume: a
    /// resumed key's `available` and the rate it lends are exact, and must
    /// be promised before anything is granted, or a crash would take it for
    /// a key at rest). Returns the promises, for a fresh log.
    pub fn reserve_current_keys(&mut self, now_ns: u64) -> Vec<(KeyId, Reservation)> {
        if self.reservations.is_none() {
            return Vec::new();
        }
        let mut all: Vec<(KeyId, Reservation)> = self
            .keys
            .iter_mut()
            .map(|(k, l)| {
                l.advance(now_ns);
                (
                    k.clone(),
                    Reservation {
                        floor: l.available(),
                        rate_cap_utps: l.rates_out_utps(),
                    },
                )
            })
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        self.reservations = Some(Reservations::restored(all.iter().cloned()));
        all
    }

    /// The write-ahead reservations, if this core keeps them.
    pub fn reservations_mut(&mut self) -> Option<&mut Reservations> {
        self.reservations.as_mut()
    }

    /// Records appended to the reservation log so far (0 without one): a
    /// reply may be sent once the driver has made this many durable.
    pub fn reservation_seq(&self) -> u64 {
        self.reservations.as_ref().map_or(0, Reservations::seq)
    }
}
