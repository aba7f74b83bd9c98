//! Write-ahead reservations of the global allocator (SPEC §2 "Restarts"),
//! sans-IO: what the allocator has promised durably about each key, and
//! the records it must make durable before a grant that breaks a promise
//! may be sent.
//!
//! A key's [`Reservation`] says: until a newer record is durable, the
//! key's `available` stays at or above `floor`, and the rates lent out of it
//! stay at or below `rate_cap_utps`. A key without one is at rest: full,
//! nothing lent. A grant that takes `available` below the floor (or lends
//! more rate than the cap) appends a new record with the floor lowered a
//! *slack* below what is left (and the cap raised), and the reply waits
//! until that record is durable (the driver, `server::LeaseService`): the
//! next grants of the key then need no write until the slack is used.
//!
//! After a crash the allocator resumes each recorded key at its floor,
//! with everything else of its burst (`B - floor`) as one phantom lease
//! that lends `rate_cap_utps`, until the longest lease the predecessor
//! could have granted has expired; keys without a record start full. That
//! state is below the true one at the crash in every respect (`available`
//! was at least the floor, what was leased at most `B` minus it, the rates
//! at most the cap), so whatever the true ledger could still grant, the
//! resumed one grants no more (docs/protocol.md, "Restarts"). A key loses
//! at most its slack and what refilled since its last record; the sweep
//! raises floors of keys that refilled, and a key dropped at rest is
//! recorded at rest.

use std::collections::HashMap;

use quotalease_model::bucket::rate_utps;
use quotalease_model::key::KeyId;
use quotalease_model::rules::Rate;

/// A key's durable promise (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// `available` stays at or above this.
    pub floor: u64,
    /// Rates lent out stay at or below this (micro-tokens per second).
    pub rate_cap_utps: u64,
}

/// One record of the reservation log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// The key's promise from now on.
    Set(KeyId, Reservation),
    /// The key is at rest (dropped full with nothing outstanding).
    AtRest(KeyId),
}

/// The reservations of a running allocator.
#[derive(Debug, Default)]
pub struct Reservations {
    by_key: HashMap<KeyId, Reservation>,
    pending: Vec<Record>,
    /// Records appended so far; the driver confirms them by this count.
    seq: u64,
    /// The log no longer describes the ledger (its state was lost, see
    /// `AllocatorCore::ledger_lost`): the driver deletes it, and a restart
    /// falls back to the whole start-up wait.
    invalid: bool,
}

/// How far below what is left a new floor goes: an eighth of the burst or
/// a quarter of a second of rate, whichever is more (at least a token), so
/// a busy key needs a durable write every few renewals, not every one.
pub fn floor_slack(rate: Rate, burst: u64) -> u64 {
    let quarter_s = rate.tokens.saturating_mul(250) / rate.period_s.max(1).saturating_mul(1000);
    (burst / 8).max(quarter_s).max(1)
}

/// The rate cap recorded when `rates_out_utps` are lent: a quarter more
/// (or a sixteenth of the rule's rate), at most the rule's rate.
pub fn rate_cap(rate: Rate, rates_out_utps: u64) -> u64 {
    let r = rate_utps(rate);
    rates_out_utps
        .saturating_add((rates_out_utps / 4).max(r / 16))
        .min(r)
}

impl Reservations {
    /// Reservations that start from `records` (a restart's recovered ones).
    pub fn restored(records: impl IntoIterator<Item = (KeyId, Reservation)>) -> Self {
        Self {
            by_key: records.into_iter().collect(),
            ..Self::default()
        }
    }

    /// After a grant of `key` left `available` tokens and lends
    /// `rates_out_utps`: record a new promise if the current one no longer
    /// holds. Returns whether a record was added (the reply must wait for
    /// it to be durable).
    pub fn after_grant(
        &mut self,
        key: &KeyId,
        available: u64,
        rates_out_utps: u64,
        rate: Rate,
        burst: u64,
    ) -> bool {
        if self.invalid {
            return false;
        }
        let cur = self.by_key.get(key).copied().unwrap_or(Reservation {
            floor: burst,
            rate_cap_utps: 0,
        });
        if available >= cur.floor && rates_out_utps <= cur.rate_cap_utps {
            return false;
        }
        let floor = if available < cur.floor {
            available.saturating_sub(floor_slack(rate, burst))
        } else {
            cur.floor
        };
        let rate_cap_utps = if rates_out_utps > cur.rate_cap_utps {
            rate_cap(rate, rates_out_utps).max(rates_out_utps)
        } else {
            cur.rate_cap_utps
        };
        self.set(
            key,
            Reservation {
                floor,
                rate_cap_utps,
            },
        );
        true
    }

    /// The sweep looked at `key` (it has `available` tokens and lends
    /// `rates_out_utps`): raise its promise when it refilled by more than
    /// twice the slack (nothing waits for this record).
    pub fn raise(
        &mut self,
        key: &KeyId,
        available: u64,
        rates_out_utps: u64,
        rate: Rate,
        burst: u64,
    ) {
        if self.invalid {
            return;
        }
        let Some(cur) = self.by_key.get(key).copied() else {
            return;
        };
        let slack = floor_slack(rate, burst);
        let floor = available.saturating_sub(slack);
        let cap = rate_cap(rate, rates_out_utps).max(rates_out_utps);
        let raise_floor = floor > cur.floor.saturating_add(slack);
        // A cap well above what is lent comes down too (a later grant that
        // lends more records a new one before it is sent).
        let lower_cap = cap < cur.rate_cap_utps / 2;
        if raise_floor || lower_cap {
            self.set(
                key,
                Reservation {
                    floor: if raise_floor { floor } else { cur.floor },
                    rate_cap_utps: if lower_cap { cap } else { cur.rate_cap_utps },
                },
            );
        }
    }

    /// `key` was dropped at rest.
    pub fn at_rest(&mut self, key: &KeyId) {
        if self.invalid {
            return;
        }
        if self.by_key.remove(key).is_some() {
            self.pending.push(Record::AtRest(key.clone()));
            self.seq += 1;
        }
    }

    fn set(&mut self, key: &KeyId, r: Reservation) {
        self.by_key.insert(key.clone(), r);
        self.pending.push(Record::Set(key.clone(), r));
        self.seq += 1;
    }

    /// The log no longer describes the ledger (see the field).
    pub fn invalidate(&mut self) {
        self.invalid = true;
        self.by_key.clear();
        self.pending.clear();
    }

    /// Whether [`Reservations::invalidate`] was called.
    pub fn is_invalid(&self) -> bool {
        self.invalid
    }

    /// Records appended so far.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The records not yet handed to the driver, and the count they bring
    /// the log to once durable.
    pub fn take(&mut self) -> (u64, Vec<Record>) {
        (self.seq, std::mem::take(&mut self.pending))
    }

    /// Every current promise (for a compacted log), and the count it
    /// covers; pending records are part of it.
    pub fn snapshot(&mut self) -> (u64, Vec<(KeyId, Reservation)>) {
        self.pending.clear();
        let mut all: Vec<_> = self.by_key.iter().map(|(k, r)| (k.clone(), *r)).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        (self.seq, all)
    }

    /// The promise for `key`, if it has one.
    pub fn get(&self, key: &KeyId) -> Option<Reservation> {
        self.by_key.get(key).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(t: &str) -> KeyId {
        KeyId::new("r", t, String::new())
    }

    const R: Rate = Rate {
        tokens: 100,
        period_s: 1,
    };

    #[test]
    fn a_grant_below_the_floor_records_a_lower_one_with_slack() {
        let mut r = Reservations::default();
        // A fresh key (at rest: floor B) drawn to 90 of 100.
        assert!(r.after_grant(&key("a"), 90, 0, R, 100));
        let slack = floor_slack(R, 100);
        assert_eq!(slack, 25);
        assert_eq!(r.get(&key("a")).unwrap().floor, 65);
        // Within the slack: nothing to write.
        assert!(!r.after_grant(&key("a"), 70, 0, R, 100));
        assert!(r.after_grant(&key("a"), 60, 0, R, 100));
        assert_eq!(r.get(&key("a")).unwrap().floor, 35);
        // Lending a rate records a cap above it, at most the rule's rate.
        assert!(r.after_grant(&key("a"), 60, 40_000_000, R, 100));
        let cap = r.get(&key("a")).unwrap().rate_cap_utps;
        assert!((40_000_000..=100_000_000).contains(&cap), "{cap}");
        assert!(!r.after_grant(&key("a"), 60, cap, R, 100));
        let (seq, recs) = r.take();
        assert_eq!((seq, recs.len()), (3, 3));
        assert_eq!(r.take().1, vec![]);
    }

    #[test]
    fn the_sweep_raises_refilled_floors_and_records_keys_at_rest() {
        let mut r = Reservations::default();
        r.after_grant(&key("a"), 0, 0, R, 100);
        assert_eq!(r.get(&key("a")).unwrap().floor, 0);
        r.raise(&key("a"), 40, 0, R, 100);
        assert_eq!(r.get(&key("a")).unwrap().floor, 0, "within twice the slack");
        r.raise(&key("a"), 80, 0, R, 100);
        assert_eq!(r.get(&key("a")).unwrap().floor, 55);
        r.at_rest(&key("a"));
        assert_eq!(r.get(&key("a")), None);
        let (_, recs) = r.take();
        assert_eq!(recs.last(), Some(&Record::AtRest(key("a"))));
        // Unknown keys are not raised; an invalid log records nothing.
        r.raise(&key("b"), 80, 0, R, 100);
        r.invalidate();
        assert!(!r.after_grant(&key("c"), 0, 0, R, 100));
        assert_eq!(r.take().1, vec![]);
    }

    #[test]
    fn slow_rules_get_a_token_of_slack() {
        let per_day = Rate {
            tokens: 1,
            period_s: 86_400,
        };
        assert_eq!(floor_slack(per_day, 10), 1);
        assert_eq!(rate_cap(per_day, 0), rate_utps(per_day) / 16);
    }
}
