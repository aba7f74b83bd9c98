//! The one clock abstraction. Every core takes time as an argument (`u64`
//! nanoseconds); drivers read it from a [`Clock`].
//!
//! Production uses `CLOCK_BOOTTIME` ([`BootClock`]): monotonic, and it keeps
//! counting while the machine is suspended, so a lease cannot outlive its
//! real lifetime across a suspend (SPEC §2 "Clocks"). Tests and drivers that
//! own time (the simulator) use a [`ManualClock`]. A driver holds a
//! [`ClockSource`]: the boot clock is read with a direct `clock_gettime`,
//! without a virtual call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A monotonic source of nanoseconds.
pub trait Clock: Send + Sync {
    /// Nanoseconds since an arbitrary fixed origin. Never decreases.
    fn now_ns(&self) -> u64;
}

/// `CLOCK_BOOTTIME` (Linux); falls back to `CLOCK_MONOTONIC` elsewhere.
#[derive(Clone, Copy, Debug, Default)]
pub struct BootClock;

impl BootClock {
    /// Read the clock once.
    #[inline]
    pub fn now() -> u64 {
        #[cfg(target_os = "linux")]
        const ID: libc::clockid_t = libc::CLOCK_BOOTTIME;
        #[cfg(not(target_os = "linux"))]
        const ID: libc::clockid_t = libc::CLOCK_MONOTONIC;
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; clock_gettime only writes it.
        let rc = unsafe { libc::clock_gettime(ID, &mut ts) };
        debug_assert_eq!(rc, 0, "clock_gettime(CLOCK_BOOTTIME) cannot fail on Linux");
        (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
    }
}

impl Clock for BootClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        Self::now()
    }
}

/// A clock that moves only when told to (tests, the simulator). Clones
/// share the reading: the driver keeps one and sets it, the code under
/// test reads another.
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A manual clock reading `start_ns`.
    pub fn new(start_ns: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_ns)))
    }
    /// Move the clock forward by `ns`.
    pub fn advance(&self, ns: u64) {
        self.0.fetch_add(ns, Ordering::AcqRel);
    }
    /// Set the reading (tests may move it backwards to check that negative
    /// elapsed time creates nothing).
    pub fn set(&self, ns: u64) {
        self.0.store(ns, Ordering::Release);
    }
    /// The current reading.
    #[inline]
    pub fn now(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now_ns(&self) -> u64 {
        self.now()
    }
}

/// Where a driver reads time: the boot clock (the default, read directly),
/// a [`ManualClock`] (read directly) or any other [`Clock`] (a virtual call
/// per reading; `tests/turmoil_net.rs` reads turmoil's simulated time).
#[derive(Clone, Default)]
pub enum ClockSource {
    /// `CLOCK_BOOTTIME`.
    #[default]
    Boot,
    /// A reading set by the driver.
    Manual(ManualClock),
    /// Any other source, read on every call.
    Other(Arc<dyn Clock>),
}

impl ClockSource {
    /// The current reading.
    #[inline]
    pub fn now(&self) -> u64 {
        match self {
            ClockSource::Boot => BootClock::now(),
            ClockSource::Manual(c) => c.now(),
            ClockSource::Other(c) => c.now_ns(),
        }
    }
}

impl Clock for ClockSource {
    #[inline]
    fn now_ns(&self) -> u64 {
        self.now()
    }
}

impl std::fmt::Debug for ClockSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClockSource::Boot => f.write_str("Boot"),
            ClockSource::Manual(c) => f.debug_tuple("Manual").field(&c.now()).finish(),
            ClockSource::Other(_) => f.write_str("Other"),
        }
    }
}

impl From<ManualClock> for ClockSource {
    fn from(c: ManualClock) -> Self {
        ClockSource::Manual(c)
    }
}

impl From<Arc<dyn Clock>> for ClockSource {
    fn from(c: Arc<dyn Clock>) -> Self {
        ClockSource::Other(c)
    }
}

/// Milliseconds to nanoseconds, saturating.
pub const fn ms_to_ns(ms: u64) -> u64 {
    ms.saturating_mul(1_000_000)
}

/// Nanoseconds to milliseconds, rounded up.
pub const fn ns_to_ms_ceil(ns: u64) -> u64 {
    ns.div_ceil(1_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_clock_is_monotonic() {
        let a = BootClock::now();
        let b = BootClock::now();
        assert!(b >= a);
        assert!(a > 0);
    }

    #[test]
    fn manual_clock_clones_share_the_reading() {
        let driver = ManualClock::new(5);
        let source = ClockSource::from(driver.clone());
        assert_eq!(source.now(), 5);
        driver.advance(10);
        assert_eq!(source.now_ns(), 15);
        driver.set(3);
        assert_eq!(source.now(), 3);
        let other = ClockSource::from(Arc::new(driver.clone()) as Arc<dyn Clock>);
        assert_eq!(other.now(), 3);
        assert!(ClockSource::default().now() > 0);
        assert_eq!(format!("{source:?}"), "Manual(3)");
    }

    #[test]
    fn conversions_round_up() {
        assert_eq!(ns_to_ms_ceil(1), 1);
        assert_eq!(ns_to_ms_ceil(1_000_000), 1);
        assert_eq!(ns_to_ms_ceil(1_000_001), 2);
        assert_eq!(ms_to_ns(u64::MAX), u64::MAX);
    }
}
