//! `etcfs mount`: mount, serve until unmounted or signalled, unmount on the way out.

use std::{
    ffi::OsString,
    os::{fd::AsFd as _, unix::process::CommandExt as _},
    path::Path,
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use fusedev::{
    mount::{self, Mount, MountOptions},
    opcode::Opcode,
    server::Handler,
    transport::{Session, SessionConfig, TransportChoice},
};
use signal_hook::{consts::SIGINT, consts::SIGTERM, iterator::Signals};

use crate::{control, embedded, fs, memfs, sdnotify, stats, MkfsArgs, MountArgs, Transport};

/// How `etcfs mount` was started, beyond its flags.
#[derive(Debug, Clone)]
pub(crate) struct Invocation {
    /// The command line as `etcfs mount` flags (`-o` expanded; the mount helper's
    /// translated): what a detaching mount runs again, in the foreground, as the daemon.
    pub(crate) argv: Vec<OsString>,
    /// NOTIFY_SOCKET: a service manager waits for `READY=1` on it (`sdnotify`).
    pub(crate) notify_socket: Option<OsString>,
}

/// How long a detaching `etcfs mount` waits for its daemon to finish mounting.
const MOUNT_READY_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) fn mkfs(args: MkfsArgs) -> Result<()> {
    let (etcd, device) = match (&args.store.etcd[..], &args.store.device) {
        ([_, ..], Some(device)) => (
            args.store
                .access
                .config(&args.store.etcd, &args.store.prefix)?,
            device.clone(),
        ),
        _ => bail!("mkfs needs both --etcd URLS and --device PATH"),
    };
    if args.group_size == 0 {
        bail!("--group-size must be at least 1 MiB");
    }
    let ag_blocks = (args.group_size << 20) / crate::data::BLOCK_SIZE;
    let r = fs::mkfs(&etcd, &device, &args.store.prefix, ag_blocks, args.force)?;
    println!(
        "etcfs: formatted {} as filesystem {} ({} MiB, {} allocation groups, {}-byte blocks), \
         metadata under prefix {:?}",
        device.display(),
        r.uuid,
        r.device_bytes >> 20,
        r.groups,
        r.block_size,
        args.store.prefix
    );
    Ok(())
}

pub(crate) fn mount(args: MountArgs, inv: Invocation) -> Result<()> {
    // main.rs turns every -o into flags before parsing (`mount_opts::expand_argv`); one
    // that got past it must not be dropped silently (a forgotten `ro`).
    if !args.options.is_empty() {
        bail!(
            "-o {} was not taken as options; give it as `-o OPTS`",
            args.options.join(",")
        );
    }
    // Checked before anything starts (a private etcd, a detached daemon), so a bad mount
    // point is the one error shown; the mount itself checks again.
    let mountpoint = mount::check_mountpoint(&args.mountpoint)?;
    let notifier = inv.notify_socket.clone().map(sdnotify::Notifier::new);
    // Likewise the metrics port: listened on before anything is mounted (the detaching
    // parent only tries, so that the reason is its own error, and lets its child listen).
    let metrics = args.metrics.as_deref().map(stats::http::bind).transpose()?;
    if !args.foreground {
        drop(metrics);
        return spawn_detached(&args, &mountpoint, &inv.argv, notifier.as_ref());
    }
    let cpus = worker_cpus(args.cpus.as_deref())?;
    let attr_timeout = seconds(args.attr_timeout, "--attr-timeout")?;
    let entry_timeout = seconds(args.entry_timeout, "--entry-timeout")?;
    if args.memfs {
        let handler: Arc<dyn Handler> = Arc::new(memfs::MemFs::new(memfs::MemFsConfig {
            attr_timeout,
            entry_timeout,
            uid: nix_uid(),
            gid: nix_gid(),
        }));
        return serve(&args, &cpus, handler, notifier.as_ref(), metrics);
    }
    // The private etcd of the embedded default lives as long as the mount.
    let mut private_etcd = None;
    let (etcd, device) = match (&args.store.etcd[..], &args.store.device) {
        ([_, ..], Some(device)) => (
            args.store
                .access
                .config(&args.store.etcd, &args.store.prefix)?,
            device.clone(),
        ),
        ([], None) => {
            if args.store.access.any() {
                bail!(
                    "the --etcd-* certificate and user options are for an etcd given with \
                     --etcd; the embedded etcd makes its own certificates"
                );
            }
            let state = embedded::StateDir::new(&args.state_dir)?;
            let etcd = embedded::PrivateEtcd::start(&state)?;
            let device = state.device_image(args.image_gib << 30)?;
            let mut config = etcd.config.clone();
            config.probe_key = crate::access::probe_key(&args.store.prefix);
            private_etcd = Some(etcd);
            if !state.is_formatted() {
                let r = fs::mkfs(
                    &config,
                    &device,
                    &args.store.prefix,
                    crate::data::superblock::AG_BLOCKS_DEFAULT,
                    false,
                )
                .context("format the embedded default's device image")?;
                log::info!("formatted {} as filesystem {}", device.display(), r.uuid);
                state.mark_formatted()?;
            }
            (config, device)
        }
        _ => bail!("give both --etcd and --device, or neither (for the embedded default)"),
    };
    let handler: Arc<dyn Handler> = Arc::new(fs::EtcFs::open(fs::FsConfig {
        etcd,
        device,
        prefix: args.store.prefix.clone(),
        attr_timeout,
        entry_timeout,
        negative_timeout: seconds(args.negative_timeout, "--negative-timeout")?,
        dir_names_max: args.dir_names_max as usize,
        cores: cpus.len(),
        lock_min_hold: std::time::Duration::from_millis(args.lock_min_hold_ms),
        lease_ttl_s: args.lease_ttl,
        noatime: args.noatime,
        read_only: args.read_only,
        selinux_xattr: args.selinux_xattr,
    })?);
    let result = serve(&args, &cpus, handler, notifier.as_ref(), metrics);
    drop(private_etcd);
    result
}

fn serve(
    args: &MountArgs,
    cpus: &[usize],
    handler: Arc<dyn Handler>,
    notifier: Option<&sdnotify::Notifier>,
    metrics: Option<std::net::TcpListener>,
) -> Result<()> {
    let choice = match args.transport {
        Transport::Auto => TransportChoice::Auto,
        Transport::Uring => TransportChoice::Uring,
        Transport::Devfuse => TransportChoice::Devfuse,
    };
    let uring_possible = if choice == TransportChoice::Devfuse {
        false
    } else {
        let (available, changed) = mount::ensure_uring_enabled();
        if changed {
            log::info!("turned on /sys/module/fuse/parameters/enable_uring for FUSE-over-io_uring");
        }
        available
    };
    if let Err(e) = mount::raise_nofile_limit() {
        log::warn!("cannot raise the open-file limit: {e}");
    }
    // Signals are taken before mounting so a SIGTERM during start-up still unmounts.
    let mut signals = Signals::new([SIGINT, SIGTERM]).context("install signal handlers")?;
    let opts = MountOptions {
        fsname: fsname(args),
        allow_other: args.allow_other,
        noatime: args.noatime,
        read_only: args.read_only,
        noexec: args.noexec,
        uid: nix_uid(),
        gid: nix_gid(),
    };
    let mnt = Arc::new(Mount::new(&args.mountpoint, &opts)?);
    let names: Vec<&'static str> = Opcode::NAMES.to_vec();
    let registry = perf::Registry::new(
        names,
        fusedev::transport::COUNTERS.to_vec(),
        cpus.len() + 1,
        args.perf,
    );
    let cfg = SessionConfig {
        transport: choice,
        cpus: cpus.to_vec(),
        ring_entries_per_queue: args.ring_entries_per_queue.map_or(0, |n| n as usize),
        ring_share_above: args.ring_share_above as usize,
        devfuse_reads_per_core: args.devfuse_reads_per_core as usize,
        device_spin: std::time::Duration::from_micros(args.device_spin_us),
        ring_linger: std::time::Duration::from_micros(args.ring_linger_us),
    };
    let handler_for_stats = handler.clone();
    let session = Session::start(mnt.clone(), handler, registry.clone(), &cfg, uring_possible)
        .with_context(|| format!("start serving {}", mnt.mountpoint().display()))?;
    fs::set_notifier(session.notifier());
    let stats = Arc::new(stats::Stats::new(
        registry,
        handler_for_stats,
        session.transport().to_string(),
    ));
    let for_socket = stats.clone();
    let report: Arc<control::ReportFn> = Arc::new(move |ask| for_socket.answer(ask));
    let socket = control::serve(mnt.mountpoint(), report)?;
    if let Some(listener) = metrics {
        let at = stats::http::serve(listener, stats)?;
        log::info!("serving Prometheus metrics at http://{at}/metrics");
    }
    let stopper = session.stopper();
    let stop_notifier = notifier.cloned();
    std::thread::Builder::new()
        .name("etcfs-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                log::info!("signal {sig}: unmounting");
                if let Some(n) = &stop_notifier {
                    n.send_logged("STOPPING=1");
                }
                stopper.shutdown();
            }
        })
        .context("spawn signal thread")?;
    println!(
        "etcfs: mounted {} (transport {}, {} worker{})",
        mnt.mountpoint().display(),
        session.transport(),
        cpus.len(),
        if cpus.len() == 1 { "" } else { "s" }
    );
    // Mounted, answering, and `etcfs stats` reaches it: what a dependant may count on.
    if let Some(n) = notifier {
        n.send_logged(&format!(
            "READY=1\nMAINPID={}\nSTATUS=serving {}",
            std::process::id(),
            mnt.mountpoint().display()
        ));
    }
    session.wait();
    socket.remove();
    if mnt.unmount().context("unmount")? {
        log::info!("unmounted {}", mnt.mountpoint().display());
    }
    Ok(())
}

/// The mount's source in /proc/mounts: `--fsname`, else the spec the mount helper would
/// take for this mount (`mount_opts::Spec`), so `findmnt` and fstab lines read alike.
fn fsname(args: &MountArgs) -> String {
    if let Some(n) = &args.fsname {
        return n.clone();
    }
    if args.memfs {
        return "etcfs-memfs".into();
    }
    if args.store.etcd.is_empty() {
        return "etcfs".into();
    }
    format!("{}:/{}", args.store.etcd.join(","), args.store.prefix)
}

/// The CPUs to run workers on: `--cpus`, checked against what this process may use, or all
/// of those.
fn worker_cpus(list: Option<&str>) -> Result<Vec<usize>> {
    let allowed = uring::cpu::allowed_cpus().context("read this process's CPU affinity")?;
    let Some(list) = list else { return Ok(allowed) };
    let cpus = uring::cpu::parse_cpu_list(list).map_err(anyhow::Error::msg)?;
    if let Some(c) = cpus.iter().find(|c| !allowed.contains(c)) {
        bail!("--cpus: CPU {c} is not available to this process (allowed: {allowed:?})");
    }
    Ok(cpus)
}

fn seconds(v: f64, flag: &str) -> Result<Duration> {
    if !v.is_finite() || !(0.0..=86_400.0).contains(&v) {
        bail!("{flag} must be between 0 and 86400 seconds, got {v}");
    }
    Ok(Duration::from_secs_f64(v))
}

fn nix_uid() -> u32 {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
        .unwrap_or(0)
}

fn nix_gid() -> u32 {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::gid(&m))
        .unwrap_or(0)
}

/// Enters the mount namespace `ns` (a file such as /proc/PID/ns/mnt, or a PID), for the
/// mount helper's `-N`. Only a single-threaded process may (setns(2)).
pub(crate) fn enter_mount_namespace(ns: &str) -> Result<()> {
    let path = if !ns.is_empty() && ns.bytes().all(|b| b.is_ascii_digit()) {
        format!("/proc/{ns}/ns/mnt")
    } else {
        ns.to_string()
    };
    let f =
        std::fs::File::open(&path).with_context(|| format!("open the mount namespace {path}"))?;
    rustix::thread::move_into_link_name_space(
        f.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::Mount),
    )
    .with_context(|| format!("enter the mount namespace {path}"))?;
    Ok(())
}

/// Runs `argv` (this `etcfs mount` as flags) again in the foreground as a detached child
/// with its output in a log file, and returns once the child has mounted (or reports why
/// it could not). A service manager waiting on NOTIFY_SOCKET is told the child is the
/// service's main process and is ready; the child itself is not given the socket.
fn spawn_detached(
    args: &MountArgs,
    mountpoint: &Path,
    argv: &[OsString],
    notifier: Option<&sdnotify::Notifier>,
) -> Result<()> {
    let log_path = match &args.log_file {
        Some(p) => p.clone(),
        None => {
            let dir = Path::new("/var/log/etcfs");
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
            let name = control::socket_path(mountpoint);
            let stem = name
                .file_stem()
                .map(|s| s.to_os_string())
                .unwrap_or_default();
            dir.join(stem).with_extension("log")
        }
    };
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("open log file {}", log_path.display()))?;
    let exe = std::env::current_exe().context("find the etcfs executable")?;
    // `--foreground` right after `mount`: the mount point may follow a `--`.
    let mut child_args: Vec<OsString> = argv.iter().skip(1).cloned().collect();
    child_args.insert(1.min(child_args.len()), "--foreground".into());
    let mut child = Command::new(exe)
        .args(child_args)
        .env_remove("NOTIFY_SOCKET")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("start the etcfs daemon")?;
    let start = Instant::now();
    while start.elapsed() < MOUNT_READY_TIMEOUT {
        if let Some(status) = child.try_wait()? {
            let tail = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "the daemon exited ({status}) before mounting:\n{}",
                tail.join("\n")
            );
        }
        if mount::is_mount_point(mountpoint).unwrap_or(false)
            && control::socket_path(mountpoint).exists()
        {
            println!(
                "etcfs: mounted {} (daemon pid {}, log {})",
                mountpoint.display(),
                child.id(),
                log_path.display()
            );
            if let Some(n) = notifier {
                n.send_logged(&format!("MAINPID={}\nREADY=1", child.id()));
            }
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    bail!(
        "the daemon did not mount {} within {MOUNT_READY_TIMEOUT:?}",
        mountpoint.display()
    )
}
