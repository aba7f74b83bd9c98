//! Housekeeping: expired unspent tokens collected, full idle keys and
//! silent holders dropped, a few keys at a time.

use super::*;

impl AllocatorCore {
    /// Housekeeping at `now_ns`, all of it (see [`AllocatorCore::sweep_step`]).
    pub fn sweep(&mut self, now_ns: u64) {
        while self.sweep_step(now_ns, usize::MAX) {}
    }

    /// One step of housekeeping at `now_ns`: look at up to `max_keys` keys
    /// that are due, collect their expired unspent tokens, drop those that
    /// are full with nothing outstanding (a missing key means a full
    /// bucket); on the last step, drop holders silent for
    /// `holder_idle_ns`. Returns whether keys are still due (call again:
    /// a driver releases its lock between steps, so a sweep over a million
    /// keys never holds up grants).
    pub fn sweep_step(&mut self, now_ns: u64, max_keys: usize) -> bool {
        let mut looked = 0;
        while let Some(std::cmp::Reverse((due, _))) = self.sweep_due.peek() {
            if *due > now_ns {
                break;
            }
            if looked == max_keys {
                return true;
            }
            let std::cmp::Reverse((due, key)) = self.sweep_due.pop().expect("peeked");
            let Some(ledger) = self.keys.get_mut(&key) else {
                continue;
            };
            if ledger.sweep_due_ns != due {
                continue; // stale: the ledger was replaced or re-queued
            }
            looked += 1;
            let full = ledger.is_full_and_idle(now_ns);
            self.stats.tokens_expired_unused += ledger.take_expired_unused();
            if full {
                self.keys.remove(&key);
                if let Some(r) = &mut self.reservations {
                    r.at_rest(&key);
                }
                self.stats.keys_dropped += 1;
                if let Some(c) = self.keys_per_rule.get_mut(key.rule()) {
                    *c = c.saturating_sub(1);
                }
                continue;
            }
            if let Some(r) = &mut self.reservations {
                ledger.advance(now_ns);
                r.raise(
                    &key,
                    ledger.available(),
                    ledger.rates_out_utps(),
                    ledger.rate(),
                    ledger.burst(),
                );
            }
            match ledger.next_sweep_ns(now_ns) {
                Some(at) => {
                    // Never sooner than a beat later: a key renewed all the
                    // time comes back once per lease, not once per sweep.
                    let at = at.max(now_ns.saturating_add(SWEEP_MIN_GAP_NS));
                    ledger.sweep_due_ns = at;
                    self.sweep_due.push(std::cmp::Reverse((at, key)));
                }
                None => ledger.sweep_due_ns = 0,
            }
        }
        self.sweep_slot_keys(now_ns);
        let idle = self.cfg.holder_idle_ns;
        let names = &mut self.holder_names;
        let forwarded = &mut self.forwarded;
        self.holders.retain(|_, h| {
            let keep = h.last_seen_ns.saturating_add(idle) > now_ns;
            if !keep {
                names.remove(&h.id);
                forwarded.remove(&h.id);
            }
            keep
        });
        false
    }
}
