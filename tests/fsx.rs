//! fsx (the `fsx` crate, File System eXerciser) against a file on a real etcfs mount: a
//! bounded, seeded run (reads, writes, mmap reads and writes, truncates, fsync/fdatasync,
//! fallocate, punch hole, copy_file_range, sendfile, close/reopen), every read checked
//! against fsx's model of the file. The long run is `scripts/soak-fsx.sh`.
//!
//! The binary comes from `scripts/deps.sh` (`cargo install fsx --version FSX_VERSION`), or
//! from `$FSX`. Seed and op count: `ETCFS_FSX_SEED`, `ETCFS_FSX_OPS` (defaults below); the
//! seed is printed so a failure can be replayed with `fsx -S SEED`.
//!
//! Needs root, `/dev/fuse`, `ETCD_ENDPOINTS` and the fsx binary; skips loudly otherwise,
//! and fails instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`.

mod common;

use std::{
    fs,
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use common::{loud, run_bounded, skip, TestFs};

const DEFAULT_SEED: u64 = 20_261_130;
const DEFAULT_OPS: u64 = 5000;
/// Far above what the default run takes (a few seconds); a hang fails instead of stalling CI.
const FSX_DEADLINE: Duration = Duration::from_secs(180);

/// The fsx configuration: a file of up to 4 MiB (many 4 KiB blocks, several allocation
/// extents), operations up to 256 KiB at any alignment, every operation fsx-rs has.
const FSX_TOML: &str = r#"
flen = 4194304

[opsize]
max = 262144
min = 0
align = @ALIGN@

[weights]
close_open = 2
read = 10
write = 10
mapread = 4
mapwrite = 4
invalidate = 1
truncate = 3
fsync = 1
fdatasync = 1
posix_fallocate = 2
punch_hole = 3
sendfile = 1
posix_fadvise = 1
copy_file_range = 2
"#;

/// Where the fsx binary is: `$FSX`, `fsx` on PATH, or cargo's bin directory.
fn fsx_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("FSX") {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("CARGO_HOME") {
        dirs.push(PathBuf::from(home).join("bin"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter()
        .map(|d| d.join("fsx"))
        .find(|p| p.is_file())
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// `align` 1 makes every operation unaligned; 4096 makes reads and writes whole blocks, which
/// etcfs serves on the core straight from the request's buffer (the WRITE fast path), mixed
/// with truncates, hole punches and mapped writes that take the slow paths.
fn run_fsx(test: &str, transport: &str, align: u64) {
    let Some(fs) = TestFs::new_or_skip(test, Some(transport)) else {
        return;
    };
    let Some(fsx) = fsx_binary() else {
        skip(
            test,
            "no fsx binary (scripts/deps.sh installs it; or set FSX)",
        );
        return;
    };
    let seed = env_u64("ETCFS_FSX_SEED", DEFAULT_SEED);
    let ops = env_u64("ETCFS_FSX_OPS", DEFAULT_OPS);
    let m = fs.mount(transport, &[]);
    let config = fs.base.join("fsx.toml");
    let mut toml = FSX_TOML.replace("@ALIGN@", &align.to_string());
    if align > 1 {
        // fsx-rs rounds posix_fallocate lengths down to the alignment too, so it asks for
        // zero-length ones, which every filesystem refuses (EINVAL from the VFS: ext4 as
        // well), and fsx then stops with "does not support posix_fallocate".
        toml = toml.replace("posix_fallocate = 2", "posix_fallocate = 0");
    }
    fs::write(&config, toml).expect("write fsx config");
    // fsx's logs (.fsxlog, .fsxgood) go next to the config, not onto the filesystem under test.
    let artifacts = fs.base.join("artifacts");
    fs::create_dir(&artifacts).expect("mkdir artifacts");
    loud(&format!(
        "{test}: fsx -N {ops} -S {seed} (align {align}) on etcfs ({transport}); replay with \
         ETCFS_FSX_SEED={seed} ETCFS_FSX_OPS={ops}"
    ));
    let start = Instant::now();
    let (out, in_time) = run_bounded(
        Command::new(&fsx)
            .arg("-N")
            .arg(ops.to_string())
            .arg("-S")
            .arg(seed.to_string())
            .arg("-f")
            .arg(&config)
            .arg("-P")
            .arg(&artifacts)
            .arg(m.path("fsx.file")),
        FSX_DEADLINE,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // fsx says what went wrong first, then dumps its operation log: show both ends.
    let tail = |s: &str| {
        let lines: Vec<&str> = s.lines().collect();
        if lines.len() <= 90 {
            return lines.join("\n");
        }
        format!(
            "{}\n[...]\n{}",
            lines[..30].join("\n"),
            lines[lines.len() - 60..].join("\n")
        )
    };
    assert!(
        in_time && out.status.success(),
        "fsx -S {seed} -N {ops} on etcfs ({transport}) failed ({}, in time: {in_time}) after \
         {:?}\n--- stdout (tail) ---\n{}\n--- stderr (tail) ---\n{}",
        out.status,
        start.elapsed(),
        tail(&stdout),
        tail(&stderr)
    );
    loud(&format!(
        "{test}: fsx passed {ops} ops (seed {seed}) in {:.1} s",
        start.elapsed().as_secs_f64()
    ));
    // The file fsx left behind reads back in full after a remount as well.
    let len = fs::metadata(m.path("fsx.file")).expect("stat").len();
    let before = fs::read(m.path("fsx.file")).expect("read");
    m.stop();
    let m = fs.mount(transport, &[]);
    let after = fs::read(m.path("fsx.file")).expect("read after remount");
    assert_eq!(after.len() as u64, len);
    common::assert_same_bytes("fsx file after remount", &after, &before);
}

#[test]
fn fsx_bounded_run_uring() {
    run_fsx("fsx_bounded_run_uring", "uring", 1);
}

#[test]
fn fsx_bounded_run_devfuse() {
    run_fsx("fsx_bounded_run_devfuse", "devfuse", 1);
}

#[test]
fn fsx_block_aligned_run_uring() {
    run_fsx("fsx_block_aligned_run_uring", "uring", 4096);
}

#[test]
fn fsx_block_aligned_run_devfuse() {
    run_fsx("fsx_block_aligned_run_devfuse", "devfuse", 4096);
}
