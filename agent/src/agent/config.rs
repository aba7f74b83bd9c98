//! The agent's settings ([`AgentConfig`]) and their validation.

use std::path::PathBuf;
use std::time::Duration;

use quotalease_model::clock::ClockSource;
use quotalease_model::protocol::MAX_ID_BYTES;

use crate::core::EmergencyConfig;
use crate::renewal::PlanConfig;

/// Agent settings. Defaults are documented in docs/operations.md.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Identity sent to the allocator (unique per agent).
    pub agent_id: String,
    /// Lease lifetime requested (the allocator grants at most its TTL_max).
    pub lease_ttl: Duration,
    /// Renewal planning.
    pub plan: PlanConfig,
    /// How long a request waits for a missing lease, and the bound of one
    /// allocator call.
    pub fetch_timeout: Duration,
    /// Stall allowance subtracted from every lease deadline (`epsilon`).
    pub epsilon: Duration,
    /// Largest number of keys held; beyond it new keys are refused (the
    /// request answers with the rule's fail policy) until idle keys go.
    pub max_keys: usize,
    /// Request ids remembered for idempotent replays.
    pub replay_capacity: usize,
    /// Heartbeat to the allocator when nothing else is sent (rules refresh).
    pub heartbeat: Duration,
    /// Size of the fail-open emergency buckets.
    pub emergency: EmergencyConfig,
    /// Test-only: append every admission (time, key, cost) to this file.
    pub admission_log: Option<PathBuf>,
    /// Where the agent reads time: `CLOCK_BOOTTIME` by default; a driver
    /// that owns time (the simulator) sets a [`quotalease_model::clock::ManualClock`]
    /// before each call; `tests/turmoil_net.rs` reads turmoil's time.
    pub clock: ClockSource,
    /// Incarnation sent to the allocator; default: wall-clock ns at start.
    pub incarnation: Option<u64>,
    /// Per-process nonce sent beside `agent_id` (SPEC §8): the allocator
    /// keys holders by both, so processes sharing an id stay distinct.
    /// `None` draws a random one (drivers that replay exactly, like the
    /// simulator, pass their own).
    pub instance: Option<u64>,
    /// Remember every emergency bucket opened (for the simulator's I3 check).
    pub record_emergency: bool,
    /// Most lease batches in flight at once (backpressure: more keys wait
    /// for the next batch instead of failing).
    pub max_in_flight: usize,
    /// The cluster this agent belongs to (`--cluster`; "" when not set),
    /// presented to the allocator (SPEC §2 "First start").
    pub cluster: String,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            agent_id: format!("agent-{}", std::process::id()),
            lease_ttl: Duration::from_secs(2),
            plan: PlanConfig::default(),
            fetch_timeout: Duration::from_millis(250),
            epsilon: Duration::from_millis(50),
            max_keys: 1_000_000,
            replay_capacity: 100_000,
            heartbeat: Duration::from_secs(1),
            emergency: EmergencyConfig::default(),
            admission_log: None,
            clock: ClockSource::Boot,
            incarnation: None,
            instance: None,
            record_emergency: false,
            max_in_flight: 8,
            cluster: String::new(),
        }
    }
}

/// The longest duration an agent setting accepts (longer ones would
/// overflow deadlines computed from them).
pub const MAX_SETTING: Duration = Duration::from_secs(24 * 3600);

/// An emergency-bucket fraction must be in (0, 1] (the one rule the
/// sidecar's flags and the client crate's builder share).
pub fn check_fraction(f: f64) -> Result<(), String> {
    if f > 0.0 && f <= 1.0 {
        Ok(())
    } else {
        Err(format!("{f}: must be greater than 0 and at most 1"))
    }
}

/// An agent setting out of range, naming it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct ConfigError {
    /// The setting (as its command-line flag).
    pub setting: &'static str,
    /// Why.
    pub reason: String,
}

impl AgentConfig {
    /// Check every setting: durations in `(0, MAX_SETTING]`, `epsilon` below
    /// the lease TTL, capacities above zero.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let within = |setting: &'static str, d: Duration| {
            if d.is_zero() {
                Err(ConfigError {
                    setting,
                    reason: "must be greater than zero".into(),
                })
            } else if d > MAX_SETTING {
                Err(ConfigError {
                    setting,
                    reason: format!("{d:?} is above the maximum {MAX_SETTING:?}"),
                })
            } else {
                Ok(())
            }
        };
        within("--lease-ttl", self.lease_ttl)?;
        within("--renew-interval", self.plan.renew_interval)?;
        within("--low-water", self.plan.low_water)?;
        within("--idle-release", self.plan.idle_release)?;
        within("--fetch-timeout", self.fetch_timeout)?;
        within("heartbeat", self.heartbeat)?;
        if self.epsilon >= self.lease_ttl {
            return Err(ConfigError {
                setting: "epsilon",
                reason: format!(
                    "{:?} must be below the lease TTL {:?}",
                    self.epsilon, self.lease_ttl
                ),
            });
        }
        if self.agent_id.is_empty() || self.agent_id.len() > MAX_ID_BYTES {
            return Err(ConfigError {
                setting: "--agent-id",
                reason: format!("must be 1..={MAX_ID_BYTES} bytes"),
            });
        }
        if self.max_in_flight == 0 {
            return Err(ConfigError {
                setting: "max_in_flight",
                reason: "must be greater than zero".into(),
            });
        }
        if self.max_keys == 0 {
            return Err(ConfigError {
                setting: "max_keys",
                reason: "must be greater than zero".into(),
            });
        }
        let fractions = [
            ("--emergency-rate", self.emergency.rate_fraction),
            ("--emergency-burst", self.emergency.burst_fraction),
        ];
        for (setting, f) in fractions {
            if let Some(f) = f {
                check_fraction(f).map_err(|reason| ConfigError { setting, reason })?;
            }
        }
        Ok(())
    }
}
