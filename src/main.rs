//! `etcfs`: the daemon and command-line tool of the etcfs cluster filesystem.
//!
//! This is the only place that reads the environment (but for the etcd password, read
//! where it is used: `access`), installs the logger and exits the process; everything else
//! returns errors.

mod access;
mod control;
mod daemon;
#[allow(dead_code)]
mod data;
mod embedded;
mod fs;
mod fsck;
mod memfs;
mod mount_opts;
mod sdnotify;
mod stats;
mod status;

use std::{ffi::OsString, path::PathBuf, process::ExitCode};

use clap::{CommandFactory as _, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "etcfs",
    version,
    about = "A POSIX cluster filesystem coordinated by etcd"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "parsed once per process; MountArgs is a few hundred bytes"
)]
enum Command {
    /// Format a device and an etcd prefix as a new, empty filesystem.
    Mkfs(MkfsArgs),
    /// Mount a filesystem (in the background unless --foreground).
    Mount(MountArgs),
    /// Print live per-operation statistics of a mounted filesystem, watch them change
    /// (--watch), or start them again from zero (--reset).
    Stats(stats::StatsArgs),
    /// Show a filesystem's space, its nodes (sessions, leases, groups, locks, open files)
    /// and its etcd cluster, with warnings; read from etcd, so any host can run it.
    Status {
        #[command(flatten)]
        cluster: ClusterArgs,
        /// Print one JSON object instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// End a node's session: the node stops its device I/O, drops its caches and revokes
    /// its own lease, so that its groups, locks and open records go to the other nodes
    /// (its files opened before answer EIO); then it registers anew.
    Evict {
        #[command(flatten)]
        cluster: ClusterArgs,
        /// The node: its name, or its session id as `etcfs status` prints it (needed when
        /// several nodes have the same name).
        node: String,
        /// Revoke the lease from here without waiting for the node: only for a node known
        /// to be down (a running daemon could still write until it notices).
        #[arg(long)]
        force: bool,
    },
    /// Check a filesystem's etcd records and device superblocks at one etcd revision;
    /// with --repair (no node mounted) fix what can be fixed safely. Exit codes as
    /// e2fsck: 0 clean, 1 errors corrected, 4 errors left, 8 operational error.
    Fsck(fsck::FsckArgs),
    /// Write a synthetic population of files straight into a new filesystem's etcd
    /// records (for benches/fsck.sh).
    #[command(hide = true)]
    BenchPopulate(fsck::populate::PopulateArgs),
    /// Write the manual pages (man1/etcfs.1, man1/etcfs-SUBCOMMAND.1, man8/mount.etcfs.8)
    /// under DIR (scripts/install.sh).
    #[command(hide = true)]
    Man {
        /// Where to write them.
        dir: PathBuf,
    },
}

/// Which filesystem, for the commands that only talk to etcd.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct ClusterArgs {
    /// etcd endpoints, comma-separated (e.g. http://10.0.0.1:2379,http://10.0.0.2:2379).
    #[arg(long, value_delimiter = ',', required = true)]
    pub(crate) etcd: Vec<String>,
    /// Key prefix of the filesystem in etcd.
    #[arg(long, default_value = "etcfs")]
    pub(crate) prefix: String,
    #[command(flatten)]
    pub(crate) access: access::EtcdAccess,
}

impl ClusterArgs {
    /// How to reach etcd (TLS files and the password read and checked).
    pub(crate) fn etcd_config(&self) -> anyhow::Result<meta::etcd::EtcdConfig> {
        self.access.config(&self.etcd, &self.prefix)
    }
}

/// Which FUSE transport serves the mount.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub(crate) enum Transport {
    /// FUSE-over-io_uring when the kernel offers it (turning it on as root), else devfuse.
    Auto,
    /// FUSE-over-io_uring (Linux 6.14+).
    Uring,
    /// Classic /dev/fuse, driven through io_uring, READ replies spliced.
    Devfuse,
}

/// Where the filesystem lives: etcd and the shared device.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct StoreArgs {
    /// etcd endpoints, comma-separated (e.g. http://10.0.0.1:2379,http://10.0.0.2:2379).
    #[arg(long, value_delimiter = ',')]
    pub(crate) etcd: Vec<String>,
    /// The shared block device (or a device image file).
    #[arg(long)]
    pub(crate) device: Option<PathBuf>,
    /// Key prefix of this filesystem in etcd (several filesystems can share one etcd).
    #[arg(long, default_value = "etcfs")]
    pub(crate) prefix: String,
    #[command(flatten)]
    pub(crate) access: access::EtcdAccess,
}

#[derive(clap::Args, Debug, Clone)]
pub(crate) struct MkfsArgs {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Overwrite an existing filesystem on the device or under the prefix.
    #[arg(long)]
    pub(crate) force: bool,
    /// Size of an allocation group, in MiB: the unit of space a node owns and hands to
    /// another node (at least 1; the last group may be smaller).
    #[arg(long, default_value_t = 256, value_name = "MIB")]
    pub(crate) group_size: u64,
}

#[derive(clap::Args, Debug, Clone)]
pub(crate) struct MountArgs {
    /// Directory to mount on.
    pub(crate) mountpoint: PathBuf,
    /// mount(8)-style options, comma-separated: the flags below without their dashes
    /// (device=/dev/sdb,perf), and ro, noatime, noexec; the options mount(8) and systemd
    /// read (_netdev, nofail, x-systemd.*) are passed over; see `mount.etcfs --help`.
    /// Each is turned into its flag before parsing.
    #[arg(short = 'o', long = "options", value_name = "OPTS")]
    pub(crate) options: Vec<String>,
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Without --etcd and --device: where the private etcd and device image live.
    #[arg(long, default_value = "/var/lib/etcfs")]
    pub(crate) state_dir: PathBuf,
    /// Without --device: size of a new device image, in GiB (sparse).
    #[arg(long, default_value_t = 16)]
    pub(crate) image_gib: u64,
    /// Serve a filesystem held in memory (a test fixture and transport baseline).
    #[arg(long, conflicts_with_all = ["etcd", "device"])]
    pub(crate) memfs: bool,
    /// FUSE transport.
    #[arg(long, value_enum, default_value_t = Transport::Auto)]
    pub(crate) transport: Transport,
    /// CPUs to run one pinned worker on each, e.g. `0-3,6` (default: every allowed CPU).
    #[arg(long)]
    pub(crate) cpus: Option<String>,
    /// Record per-op latency histograms (see `etcfs stats`).
    #[arg(long)]
    pub(crate) perf: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics, ADDR being HOST:PORT (e.g.
    /// 127.0.0.1:9567; 9567 is etcfs's suggested port). Latency histograms need --perf.
    /// A port that cannot be listened on fails the mount.
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics: Option<String>,
    /// Stay in the foreground instead of detaching once mounted.
    #[arg(short, long)]
    pub(crate) foreground: bool,
    /// Let users other than root use the mount.
    #[arg(long)]
    pub(crate) allow_other: bool,
    /// Never update access times (default: relatime, as Linux mounts do).
    #[arg(long)]
    pub(crate) noatime: bool,
    /// Store `security.selinux` like any other extended attribute. By default it is
    /// refused (EOPNOTSUPP), as SELinux itself refuses it on a FUSE mount, which it
    /// labels by policy and never by attribute; `ls -l` and other tools then ask once
    /// per mount instead of once per file.
    #[arg(long)]
    pub(crate) selinux_xattr: bool,
    /// Mount read-only: the kernel mount is read-only (writes answer EROFS) and the
    /// daemon writes nothing to etcd or the device of its own either (no allocation
    /// groups, no reclaims, no access times); it keeps its session, locks and open records.
    #[arg(long, visible_alias = "ro")]
    pub(crate) read_only: bool,
    /// Refuse to execute programs from the mount (the kernel's MS_NOEXEC). The mount is
    /// always nosuid and nodev.
    #[arg(long)]
    pub(crate) noexec: bool,
    /// What /proc/mounts shows as the mount's source (default: ETCD_URLS:/PREFIX, `etcfs`
    /// for the embedded default; the mount helper passes the fstab spec).
    #[arg(long, value_name = "NAME")]
    pub(crate) fsname: Option<String>,
    /// Seconds the kernel may cache attributes (kept coherent by the etcd watch; see the
    /// README).
    #[arg(long, default_value_t = 60.0)]
    pub(crate) attr_timeout: f64,
    /// Seconds the kernel may cache names (kept coherent by the etcd watch).
    #[arg(long, default_value_t = 60.0)]
    pub(crate) entry_timeout: f64,
    /// Seconds the kernel may cache an absent name (kept coherent by the etcd watch).
    #[arg(long, default_value_t = 60.0)]
    pub(crate) negative_timeout: f64,
    /// Milliseconds a node that keeps using a file may keep its cluster lock after it got
    /// it, before giving way to another node: more work per turn when nodes take turns on
    /// one file. A node that stopped using the file gives way at once.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    pub(crate) lock_min_hold_ms: u64,
    /// Seconds this node's session lease lives in etcd without a renewal: how soon after
    /// the node dies (or is cut off) its locks, groups and open files pass to the others.
    /// The node stops its own device I/O a fifth of it (at least 1 s) before the lease
    /// can expire, and registers a new session once etcd answers (ARCHITECTURE.md).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i64).range(2..=3600))]
    pub(crate) lease_ttl: i64,
    /// Names a directory may have for its whole name set to be read in one etcd range on
    /// the first lookup (later lookups in it, found or not, need no etcd); a larger
    /// directory is looked up name by name.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) dir_names_max: u64,
    /// FUSE ring entries registered per CPU queue (each holds a 1 MiB buffer).
    /// A request keeps its entry until answered, so this bounds the requests in flight per
    /// queue (fio at queue depth 32 needs 32). Default: 32, fewer on machines with many
    /// CPUs so that all queues' buffers stay within 256 MiB, but never fewer than 8.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) ring_entries_per_queue: Option<u32>,
    /// Ring transport: a worker with more than this many requests in service moves its
    /// CPU's queue to a quiet worker (on another CPU), or passes single entries to a less
    /// busy one when none is quiet, so that one process issuing deep I/O from one CPU does
    /// not share that CPU with the worker serving it; the queue comes home after 5 ms
    /// quiet. The pieces of writes larger than 512 KiB are spread over the workers at any
    /// load. 0 keeps every request on the worker of the CPU that made it.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub(crate) ring_share_above: u32,
    /// How long (µs) a worker with device I/O in flight spins for the completion before
    /// sleeping. Spinning saves the wake-up of a sleeping worker (30–90 µs on a VM) for
    /// some CPU. A transfer expected to take longer is slept through on a timer until this
    /// long before its expected end, then spun for; spins that run out back off. 0 never
    /// spins.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub(crate) device_spin_us: u64,
    /// How long (µs) a ring worker that has just answered requests made on another CPU,
    /// and has nothing else to do, spins for the next one before sleeping. A process doing
    /// synchronous I/O sends its next request within tens of µs, and waking a sleeping
    /// worker costs 30–50 µs on a VM; the spin runs on a CPU the process is not using. 0
    /// never spins for requests.
    #[arg(long, default_value_t = 80, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub(crate) ring_linger_us: u64,
    /// Requests each /dev/fuse worker reads ahead and keeps in flight (each slot holds two
    /// 0.5 MiB buffers and a pipe).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) devfuse_reads_per_core: u32,
    /// Where the background daemon writes its log.
    #[arg(long)]
    pub(crate) log_file: Option<PathBuf>,
}

/// mount(8)'s exit codes for a helper: bad invocation or options, and a failed mount.
const MOUNT_EX_USAGE: u8 = 1;
const MOUNT_EX_FAIL: u8 = 32;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_target(false)
        .init();
    let argv: Vec<OsString> = std::env::args_os().collect();
    let notify_socket = std::env::var_os("NOTIFY_SOCKET").filter(|s| !s.is_empty());
    let invoked_as = argv
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .map(|n| n.to_os_string());
    if invoked_as.as_deref() == Some(mount_opts::HELPER_NAME.as_ref()) {
        return mount_helper(argv, notify_socket);
    }
    let argv = match mount_opts::expand_argv(argv, &Cli::command()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("etcfs: {e}");
            return ExitCode::from(2);
        }
    };
    let cli = Cli::parse_from(argv.clone());
    let result = match cli.command {
        Command::Fsck(args) => return fsck::main(&args),
        Command::BenchPopulate(args) => fsck::populate::run(&args),
        Command::Man { dir } => write_man_pages(&dir),
        Command::Mkfs(args) => daemon::mkfs(args),
        Command::Mount(args) => daemon::mount(
            args,
            daemon::Invocation {
                argv,
                notify_socket,
            },
        ),
        Command::Stats(args) => stats::main(&args),
        Command::Status { cluster, json } => cluster
            .etcd_config()
            .and_then(|cfg| status::print_status(&cfg, &cluster.prefix, json)),
        Command::Evict {
            cluster,
            node,
            force,
        } => cluster
            .etcd_config()
            .and_then(|cfg| status::evict(&cfg, &cluster.prefix, &node, force)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("etcfs: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `mount.etcfs SPEC DIR [-sfnv] [-N NS] [-o OPTS] [-t TYPE]`, as mount(8) runs it: the
/// same `etcfs mount` (`mount_opts::helper_argv`), with mount(8)'s exit codes.
fn mount_helper(argv: Vec<OsString>, notify_socket: Option<OsString>) -> ExitCode {
    let h = match mount_opts::HelperArgs::try_parse_from(&argv) {
        Ok(h) => h,
        Err(e) if !e.use_stderr() => {
            // --help, --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(MOUNT_EX_USAGE);
        }
    };
    let name = mount_opts::HELPER_NAME;
    // First, while this process has one thread: setns(2) refuses a threaded process a
    // new mount namespace, and the mount point is a path in that namespace.
    if let Some(ns) = &h.namespace {
        if let Err(e) = daemon::enter_mount_namespace(ns) {
            eprintln!("{name}: {e:#}");
            return ExitCode::from(MOUNT_EX_FAIL);
        }
    }
    let mut cli = Cli::command();
    cli.build();
    let Some(mount_cmd) = cli.find_subcommand("mount") else {
        return ExitCode::from(MOUNT_EX_FAIL);
    };
    let (etcfs_argv, translated) = match mount_opts::helper_argv(&h, mount_cmd) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::from(MOUNT_EX_USAGE);
        }
    };
    for o in &translated.unknown {
        eprintln!("{name}: ignoring unknown option {o:?} (-s)");
    }
    if h.verbose {
        let words: Vec<String> = etcfs_argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        eprintln!("{name}: {}", words.join(" "));
        if !translated.ignored.is_empty() {
            eprintln!(
                "{name}: passed over (for mount(8) and systemd): {}",
                translated.ignored.join(",")
            );
        }
    }
    let args = match Cli::try_parse_from(&etcfs_argv) {
        Ok(Cli {
            command: Command::Mount(a),
        }) => a,
        Ok(_) => return ExitCode::from(MOUNT_EX_FAIL),
        Err(e) => {
            eprintln!("{name}: {}", e.render().to_string().trim_end());
            return ExitCode::from(MOUNT_EX_USAGE);
        }
    };
    if h.fake {
        return ExitCode::SUCCESS;
    }
    let inv = daemon::Invocation {
        argv: etcfs_argv,
        notify_socket,
    };
    match daemon::mount(args, inv) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::from(MOUNT_EX_FAIL)
        }
    }
}

/// The manual pages from clap's definitions, under `dir` as man(1) looks for them:
/// `man1/` holds `etcfs` and each visible subcommand (`etcfs-mount.1`...), `man8/` the
/// mount helper.
fn write_man_pages(dir: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let (man1, man8) = (dir.join("man1"), dir.join("man8"));
    for d in [&man1, &man8] {
        std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
    }
    clap_mangen::generate_to(Cli::command(), &man1)
        .with_context(|| format!("write manual pages to {}", man1.display()))?;
    let helper = clap_mangen::Man::new(mount_opts::HelperArgs::command()).section("8");
    helper
        .generate_to(&man8)
        .with_context(|| format!("write {} to {}", helper.get_filename(), man8.display()))?;
    Ok(())
}
