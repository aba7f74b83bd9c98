//! I2 of the regional's pools, checked by the tests and the simulator.

use super::*;

impl RegionalCore {
    /// Check the regional's invariants at `now_ns`, per key: the ledger's I2
    /// (`available + outstanding <= B`); with a chain, `H <= G` (what the
    /// pool and the children hold is backed by the parent lease) and every
    /// sub-lease expires no later than `E`; without one, nothing is held.
    pub fn check_i2(&mut self, now_ns: u64) -> Result<(), String> {
        self.lapse_chains(now_ns);
        for key in self.core.key_ids() {
            let chain = self.keys.get(&key).and_then(|k| k.chain.clone());
            self.check_key(now_ns, &key, chain)?;
        }
        Ok(())
    }

    /// [`RegionalCore::check_i2`] for the keys of one child batch only (what a
    /// batch can change), so that a checker can run it after every batch.
    pub fn check_i2_batch(&mut self, now_ns: u64, batch: &LeaseBatch) -> Result<(), String> {
        for item in &batch.items {
            let key = KeyId::new(&item.rule_id, &item.tenant, &item.route);
            let mut chain = self.keys.get(&key).and_then(|k| k.chain.clone());
            if chain.as_ref().is_some_and(|c| now_ns >= c.deadline_ns) {
                self.lapse_chains(now_ns);
                chain = self.keys.get(&key).and_then(|k| k.chain.clone());
            }
            self.check_key(now_ns, &key, chain)?;
        }
        Ok(())
    }

    /// I2 of one key whose chain is `chain`; a key without a ledger holds
    /// nothing to check.
    fn check_key(&mut self, now_ns: u64, key: &KeyId, chain: Option<Chain>) -> Result<(), String> {
        let Some(ledger) = self.core.ledger_mut(key) else {
            return Ok(());
        };
        let h = ledger.holding(now_ns);
        if !ledger.i2_holds() {
            return Err(format!(
                "{key:?}: available {} + outstanding {} > B {}",
                ledger.available(),
                ledger.outstanding(),
                ledger.burst()
            ));
        }
        match chain {
            Some(c) => {
                if h > c.backing() {
                    return Err(format!(
                        "{key:?}: holding {h} > what the parent lease backs {}",
                        c.backing()
                    ));
                }
                if let Some(l) = ledger
                    .leases()
                    .iter()
                    .find(|l| l.expires_ns > c.deadline_ns)
                {
                    return Err(format!(
                        "{key:?}: sub-lease {} expires at {} after the chain deadline {}",
                        l.id, l.expires_ns, c.deadline_ns
                    ));
                }
            }
            None if h > 0 => {
                return Err(format!("{key:?}: holding {h} without a parent lease"));
            }
            None => {}
        }
        Ok(())
    }
}
