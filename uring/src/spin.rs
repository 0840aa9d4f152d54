//! How a worker with device I/O in flight waits for its completion: spin, sleep, or sleep
//! for most of the expected time and spin for the rest.
//!
//! Sleeping costs a wake-up: on a VM the device's interrupt lands on one CPU, and waking a
//! halted worker goes through the hypervisor. On this machine a 4 KiB read takes about
//! 45 µs on the device and about 30 µs more to reach a sleeping worker, and a 1 MiB write
//! that the worker slept through cost about 90 µs more per write than one it spun through.
//! Spinning for the whole of a long transfer would keep a CPU busy, so for transfers
//! expected to take longer than the spin budget the worker naps on a timer and spins only
//! for the last budget before the expected completion (the kernel's hybrid polling, done
//! from user space).
//!
//! The expected latency per transfer size is steered by what the waits show, not measured:
//! a completion that wakes the nap means the estimate is late, a spin that runs out means it
//! is early. (A measured latency would include the very wake-up the nap is there to avoid.)
//! Short waits that miss back off: the next 1, 3, 7, ... 63 sleep, and a hit resets it, so a
//! device slower than the budget does not keep a CPU busy.

use std::time::Duration;

const BACKOFF_MAX: u32 = 63;
/// Size classes of the estimate, for reads and for writes: 4 KiB and below, 8 KiB, ...
/// 1 MiB and above.
const SIZE_CLASSES: usize = 9;
/// Each correction of an estimate moves it by this fraction of itself, as a shift: 1/8.
const STEP_SHIFT: u32 = 3;

/// What to do before sleeping until a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitPlan {
    /// Sleep until something completes.
    Sleep,
    /// Spin for up to this long, then sleep.
    Spin(Duration),
    /// Sleep for up to `nap` (waking early if something completes), then spin for up to
    /// `spin`, then sleep.
    NapThenSpin { nap: Duration, spin: Duration },
}

/// How a [`WaitPlan`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// Nothing to report: the plan was to sleep.
    Slept,
    /// A completion was ready when the nap ended: it woke the nap, or came just before the
    /// nap's timer.
    WokenEarly,
    /// A spin saw a completion.
    SpinHit,
    /// A spin ran out.
    SpinMiss,
}

/// The spin-or-sleep decision of one worker.
#[derive(Debug, Clone)]
pub struct SpinPolicy {
    budget: Duration,
    /// Short waits left to sleep through before trying to spin again.
    skip: u32,
    backoff: u32,
    /// Expected device latency per direction (reads, then writes) and size class, in ns;
    /// 0 = nothing known yet.
    expected_ns: [[u64; SIZE_CLASSES]; 2],
    /// The transfer whose expected completion the last plan aimed at.
    aimed: Option<Transfer>,
}

impl SpinPolicy {
    /// A policy spinning up to `budget` per wait; zero never spins.
    pub fn new(budget: Duration) -> Self {
        SpinPolicy {
            budget,
            skip: 0,
            backoff: 0,
            expected_ns: [[0; SIZE_CLASSES]; 2],
            aimed: None,
        }
    }

    /// How long a transfer is expected to take (zero: nothing known yet).
    pub fn expected(&self, t: Transfer) -> Duration {
        Duration::from_nanos(self.expected_ns[usize::from(t.write)][size_class(t.bytes)])
    }

    fn estimate(&mut self, t: Transfer) -> &mut u64 {
        &mut self.expected_ns[usize::from(t.write)][size_class(t.bytes)]
    }

    /// The plan for a wait whose first device completion, of `transfer`, is expected in
    /// `until_due`; `None` when no device I/O is in flight.
    pub fn plan(&mut self, first_due: Option<(Duration, Transfer)>) -> WaitPlan {
        self.aimed = None;
        let Some((until_due, transfer)) = first_due else {
            return WaitPlan::Sleep;
        };
        if self.budget.is_zero() {
            return WaitPlan::Sleep;
        }
        if until_due > self.budget {
            // Far off: nap until one budget before it. No backoff here: the estimate, which
            // the outcome corrects, decided to spin.
            self.aimed = Some(transfer);
            return WaitPlan::NapThenSpin {
                nap: until_due - self.budget,
                spin: self.budget,
            };
        }
        if self.skip > 0 {
            self.skip -= 1;
            return WaitPlan::Sleep;
        }
        self.aimed = Some(transfer);
        WaitPlan::Spin(self.budget)
    }

    /// Records how the last plan went, and corrects the estimate it aimed at.
    pub fn after_wait(&mut self, waited: Waited) {
        let aimed = self.aimed.take();
        match waited {
            Waited::Slept => {}
            Waited::WokenEarly => {
                if let Some(t) = aimed {
                    let e = self.estimate(t);
                    *e -= *e >> STEP_SHIFT;
                }
            }
            Waited::SpinHit => self.backoff = 0,
            Waited::SpinMiss => {
                self.backoff = (self.backoff * 2 + 1).min(BACKOFF_MAX);
                self.skip = self.backoff;
                if let Some(t) = aimed {
                    let budget = u64::try_from(self.budget.as_nanos()).unwrap_or(u64::MAX);
                    let e = self.estimate(t);
                    *e = (*e).max(budget);
                    *e = e.saturating_add(*e >> STEP_SHIFT);
                }
            }
        }
    }
}

/// A device transfer, as far as its latency goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    pub bytes: usize,
    pub write: bool,
}

fn size_class(bytes: usize) -> usize {
    let pages = bytes.div_ceil(4096).max(1);
    (pages.next_power_of_two().trailing_zeros() as usize).min(SIZE_CLASSES - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: Duration = Duration::from_micros(100);
    const PAGE: Transfer = Transfer {
        bytes: 4096,
        write: false,
    };
    const MIB: Transfer = Transfer {
        bytes: 1 << 20,
        write: true,
    };

    fn due_now(p: &mut SpinPolicy) -> WaitPlan {
        p.plan(Some((Duration::ZERO, PAGE)))
    }

    fn is_sleep(p: &mut SpinPolicy) -> bool {
        due_now(p) == WaitPlan::Sleep
    }

    #[test]
    fn short_misses_back_off_and_a_hit_resets() {
        let mut p = SpinPolicy::new(BUDGET);
        assert_eq!(due_now(&mut p), WaitPlan::Spin(BUDGET));
        p.after_wait(Waited::SpinMiss);
        // One sleep, then a try.
        assert!(is_sleep(&mut p));
        assert!(!is_sleep(&mut p));
        p.after_wait(Waited::SpinMiss);
        for _ in 0..3 {
            assert!(is_sleep(&mut p));
        }
        assert!(!is_sleep(&mut p));
        p.after_wait(Waited::SpinHit);
        assert!(!is_sleep(&mut p), "a hit spins again at once");
        // Backoff is capped.
        for _ in 0..20 {
            while is_sleep(&mut p) {}
            p.after_wait(Waited::SpinMiss);
        }
        let sleeps = std::iter::from_fn(|| is_sleep(&mut p).then_some(())).count();
        assert_eq!(sleeps as u32, BACKOFF_MAX);
    }

    #[test]
    fn zero_budget_or_no_device_io_never_spins() {
        let mut p = SpinPolicy::new(Duration::ZERO);
        assert!(is_sleep(&mut p));
        p.after_wait(Waited::SpinHit);
        assert!(is_sleep(&mut p));
        assert_eq!(
            p.plan(Some((Duration::from_millis(1), MIB))),
            WaitPlan::Sleep
        );
        let mut p = SpinPolicy::new(BUDGET);
        assert_eq!(p.plan(None), WaitPlan::Sleep);
    }

    #[test]
    fn a_far_completion_naps_until_one_budget_before_it_even_while_backing_off() {
        let mut p = SpinPolicy::new(BUDGET);
        p.after_wait(Waited::SpinMiss);
        assert_eq!(
            p.plan(Some((Duration::from_micros(350), MIB))),
            WaitPlan::NapThenSpin {
                nap: Duration::from_micros(250),
                spin: BUDGET
            }
        );
        p.after_wait(Waited::SpinHit);
        // The backoff still governs short waits.
        p.after_wait(Waited::SpinMiss);
        assert!(is_sleep(&mut p));
    }

    #[test]
    fn misses_raise_the_estimate_of_the_size_aimed_at_and_early_wakes_lower_it() {
        let mut p = SpinPolicy::new(BUDGET);
        assert_eq!(p.expected(MIB), Duration::ZERO);
        // Nothing known: spin at once; running out starts the estimate above the budget.
        assert_eq!(p.plan(Some((Duration::ZERO, MIB))), WaitPlan::Spin(BUDGET));
        p.after_wait(Waited::SpinMiss);
        assert_eq!(p.expected(MIB), Duration::from_nanos(112_500));
        assert_eq!(p.expected(PAGE), Duration::ZERO, "other sizes keep theirs");
        let mib_read = Transfer {
            write: false,
            ..MIB
        };
        assert_eq!(p.expected(mib_read), Duration::ZERO, "reads keep theirs");
        // A 300 µs device: each miss raises it by an eighth until the spin window holds it.
        let device = Duration::from_micros(300);
        let mut misses = 1;
        loop {
            let due = p.expected(MIB);
            let plan = p.plan(Some((due, MIB)));
            let WaitPlan::NapThenSpin { nap, spin } = plan else {
                assert_eq!(plan, WaitPlan::Sleep, "backing off");
                continue;
            };
            if nap + spin < device {
                p.after_wait(Waited::SpinMiss);
                misses += 1;
            } else {
                assert!(nap < device, "{nap:?}");
                p.after_wait(Waited::SpinHit);
                break;
            }
        }
        assert!(misses <= 10, "{misses}");
        let settled = p.expected(MIB);
        // The device gets faster: completions wake the nap, and each lowers the estimate.
        p.plan(Some((settled, MIB)));
        p.after_wait(Waited::WokenEarly);
        assert_eq!(p.expected(MIB), settled - settled / 8);
        // A plan that slept aims at nothing, so its outcome changes no estimate.
        let before = p.expected(MIB);
        p.plan(None);
        p.after_wait(Waited::WokenEarly);
        assert_eq!(p.expected(MIB), before);
    }

    #[test]
    fn size_classes_are_powers_of_two_pages() {
        assert_eq!(size_class(0), 0);
        assert_eq!(size_class(4096), 0);
        assert_eq!(size_class(4097), 1);
        assert_eq!(size_class(8192), 1);
        assert_eq!(size_class(128 << 10), 5);
        assert_eq!(size_class(1 << 20), 8);
        assert_eq!(size_class(usize::MAX / 2), 8);
    }
}
