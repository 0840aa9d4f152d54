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
mod stats;
mod status;

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand, ValueEnum};

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
    /// Ring transport: a worker with more than this many requests in service passes some
    /// of its CPU's queue entries to a less busy worker, so that one process issuing deep
    /// I/O from one CPU is served by several; they come back when the load drops. The
    /// pieces of writes larger than 512 KiB are spread over the workers at any load. 0 keeps
    /// every request on the worker of the CPU that made it.
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

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_target(false)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Fsck(args) => return fsck::main(&args),
        Command::BenchPopulate(args) => fsck::populate::run(&args),
        Command::Mkfs(args) => daemon::mkfs(args),
        Command::Mount(args) => daemon::mount(args),
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
