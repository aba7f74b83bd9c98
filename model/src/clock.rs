//! The one clock abstraction. Every core takes time as an argument (`u64`
//! nanoseconds); drivers read it from a [`Clock`].
//!
//! Production uses `CLOCK_BOOTTIME`: monotonic, and it keeps counting while
//! the machine is suspended, so a lease cannot outlive its real lifetime
//! across a suspend (SPEC §2 "Clocks"). Tests use [`FakeClock`].

use std::sync::atomic::{AtomicU64, Ordering};

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

/// A clock that moves only when told to. For tests.
#[derive(Debug, Default)]
pub struct FakeClock(AtomicU64);

impl FakeClock {
    /// A fake clock reading `start_ns`.
    pub fn new(start_ns: u64) -> Self {
        Self(AtomicU64::new(start_ns))
    }
    /// Move the clock forward by `ns`.
    pub fn advance(&self, ns: u64) {
        self.0.fetch_add(ns, Ordering::SeqCst);
    }
    /// Set the reading (tests may move it backwards to check that negative
    /// elapsed time creates nothing).
    pub fn set(&self, ns: u64) {
        self.0.store(ns, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
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
    fn conversions_round_up() {
        assert_eq!(ns_to_ms_ceil(1), 1);
        assert_eq!(ns_to_ms_ceil(1_000_000), 1);
        assert_eq!(ns_to_ms_ceil(1_000_001), 2);
        assert_eq!(ms_to_ns(u64::MAX), u64::MAX);
    }
}
