//! Injected time. `meta` never reads ambient time except in [`SystemClock`], so the
//! model, the pipeline's coalescing and lease expiry are deterministic under
//! [`ManualClock`] in tests.

use std::{
    sync::Mutex,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use crate::types::Timespec;

/// A source of wall-clock and monotonic time.
pub trait Clock: Send + Sync {
    /// Wall-clock time, for inode timestamps.
    fn wall(&self) -> Timespec;
    /// Monotonic time since an arbitrary origin, for intervals and lease expiry.
    fn mono(&self) -> Duration;
}

/// The real clock.
#[derive(Debug)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    /// A clock whose monotonic origin is now.
    pub fn new() -> Self {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn wall(&self) -> Timespec {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => Timespec::new(
                i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                d.subsec_nanos(),
            ),
            // A clock before 1970 is a misconfigured host; clamp rather than fail writes.
            Err(_) => Timespec::new(0, 0),
        }
    }
    fn mono(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that moves only when told to.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<Duration>,
    epoch: Timespec,
}

impl ManualClock {
    /// Starts at monotonic 0 and wall time `epoch`.
    pub fn new(epoch: Timespec) -> Self {
        ManualClock {
            now: Mutex::new(Duration::ZERO),
            epoch,
        }
    }
    /// Moves time forward.
    pub fn advance(&self, d: Duration) {
        let mut now = self
            .now
            .lock()
            .expect("clock lock is never poisoned: no panics inside");
        *now += d;
    }
}

impl Clock for ManualClock {
    fn wall(&self) -> Timespec {
        let d = self.mono();
        let nsec = u64::from(self.epoch.nsec) + u64::from(d.subsec_nanos());
        let extra = i64::try_from(nsec / 1_000_000_000).unwrap_or(0);
        let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
        Timespec::new(
            self.epoch.sec.saturating_add(secs).saturating_add(extra),
            u32::try_from(nsec % 1_000_000_000).unwrap_or(0),
        )
    }
    fn mono(&self) -> Duration {
        *self
            .now
            .lock()
            .expect("clock lock is never poisoned: no panics inside")
    }
}
