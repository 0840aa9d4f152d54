//! CPU lists, the CPUs this process may run on, and pinning.

use std::{fs, io};

/// Parses a kernel-style CPU list such as `0-3,6` (the format of `--cpus` and of
/// `/sys/devices/system/cpu/possible`). The result is sorted and free of duplicates.
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in list
        .trim()
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let parse = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| format!("invalid CPU number {s:?} in CPU list {list:?}"))
        };
        match part.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (parse(lo)?, parse(hi)?);
                if lo > hi {
                    return Err(format!("empty CPU range {part:?} in CPU list {list:?}"));
                }
                if hi >= CPU_SET_CAPACITY {
                    return Err(format!(
                        "CPU {hi} is beyond the supported {CPU_SET_CAPACITY}"
                    ));
                }
                cpus.extend(lo..=hi);
            }
            None => {
                let cpu = parse(part)?;
                if cpu >= CPU_SET_CAPACITY {
                    return Err(format!(
                        "CPU {cpu} is beyond the supported {CPU_SET_CAPACITY}"
                    ));
                }
                cpus.push(cpu);
            }
        }
    }
    if cpus.is_empty() {
        return Err(format!("CPU list {list:?} names no CPU"));
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// The width of `cpu_set_t`; CPUs at or beyond it cannot be pinned with `sched_setaffinity`.
const CPU_SET_CAPACITY: usize = 1024;

/// Every CPU the kernel may ever bring online. The FUSE ring needs one queue per possible CPU,
/// not per online or allowed CPU: a request is queued on the CPU its caller runs on, and a
/// queue without an entry blocks every request on the mount.
pub fn possible_cpus() -> io::Result<Vec<usize>> {
    let text = fs::read_to_string("/sys/devices/system/cpu/possible")?;
    parse_cpu_list(&text).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The CPUs this process may run on (its affinity mask, which a cpuset may narrow).
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain old data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: CPU_ISSET only reads `set`, and every index is below CPU_SETSIZE.
    Ok((0..CPU_SET_CAPACITY)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Sets how late the kernel may fire the calling thread's timers (its timer slack, 50 µs by
/// default): a worker napping until shortly before a device completion needs to wake on
/// time, not up to 50 µs after it.
pub fn set_timer_slack(slack: std::time::Duration) -> io::Result<()> {
    let ns = libc::c_ulong::try_from(slack.as_nanos().max(1)).unwrap_or(libc::c_ulong::MAX);
    // SAFETY: PR_SET_TIMERSLACK takes its value by integer and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, ns, 0, 0, 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Pins the calling thread to exactly `cpu`.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    if cpu >= CPU_SET_CAPACITY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("CPU {cpu} too large"),
        ));
    }
    // SAFETY: cpu_set_t is plain old data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` was checked to be below CPU_SETSIZE, so the write stays inside `set`.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 means this thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The CPU the calling thread is running on right now.
pub fn current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu takes no arguments and only returns a number.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ranges_and_singles() {
        assert_eq!(parse_cpu_list("0-3,6").unwrap(), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse_cpu_list("1\n").unwrap(), vec![1]);
        assert_eq!(parse_cpu_list("3,1,1-2").unwrap(), vec![1, 2, 3]);
    }

    #[test]
    fn rejects_garbage() {
        assert!(parse_cpu_list("").is_err());
        assert!(parse_cpu_list("a").is_err());
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("0-99999").is_err());
    }

    #[test]
    fn this_machine_has_cpus_and_pinning_works() {
        let possible = possible_cpus().unwrap();
        let allowed = allowed_cpus().unwrap();
        assert!(!possible.is_empty());
        assert!(allowed.iter().all(|c| possible.contains(c)));
        let cpu = allowed[0];
        std::thread::spawn(move || {
            pin_current_thread(cpu).unwrap();
            assert_eq!(current_cpu(), Some(cpu));
        })
        .join()
        .unwrap();
    }
}
